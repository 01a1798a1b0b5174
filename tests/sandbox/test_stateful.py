"""A stateful process survives pause/resume, snapshot/restore and fork; every copy diverges on its own.

Oracle: the counter's own arithmetic. Each bump returns n+1 of the state it was started from, so a copy that
did not continue from the exact state (or shares state with another copy) returns a different number.
"""

from __future__ import annotations

import time
from pathlib import Path

from k3.v1 import sandbox_pb2 as pb
from tests.sandbox.conftest import CGROUP_GROUP, requires_criu, requires_namespace

# A TCP round trip over 127.0.0.1: fails with "Network is unreachable" where loopback is down.
LOOPBACK_TCP = ["python3", "-c", "import socket; s = socket.create_server(('127.0.0.1', 0)); "
                "c = socket.create_connection(s.getsockname(), timeout=5); print('ok')"]


def _cpu_usage_us(backend_group: str, sandbox_id: str) -> int:
    stat = Path(f"/sys/fs/cgroup/unified/{backend_group}/{sandbox_id}/cpu.stat").read_text()
    return int(stat.split()[1])  # first line: usage_usec N


def _pause_stops_cpu(client, sid: str, group: str) -> None:
    client.run(sid, ["sh", "-c", "while :; do :; done"], background=True)  # a busy loop
    time.sleep(0.2)
    took = client.stub.PauseSandbox(pb.PauseSandboxRequest(sandbox_id=sid)).took_ms
    assert took > 0
    info = client.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sid)).sandbox
    assert info.state == pb.SANDBOX_STATE_PAUSED
    before = _cpu_usage_us(group, sid)
    time.sleep(0.3)
    assert _cpu_usage_us(group, sid) - before < 2000, "a paused sandbox kept using CPU"
    client.stub.ResumeSandbox(pb.ResumeSandboxRequest(sandbox_id=sid))
    deadline = time.monotonic() + 10  # generous: the host's cores are shared with other work
    while _cpu_usage_us(group, sid) - before < 20_000:
        assert time.monotonic() < deadline, "the busy loop did not run again after resume"
        time.sleep(0.05)
    client.sh(sid, "pkill -f 'while :'")


@requires_namespace
def test_namespace_files_survive_snapshot_restore_and_fork(client):
    sid = client.create().sandbox_id
    client.start_counter(sid)
    assert [client.bump(sid), client.bump(sid)] == [1, 2]
    _pause_stops_cpu(client, sid, CGROUP_GROUP["namespace"])
    assert client.bump(sid) == 3  # memory state intact across pause/resume

    snap = client.stub.SnapshotSandbox(pb.SnapshotSandboxRequest(sandbox_id=sid))
    assert not snap.memory  # the namespace backend snapshots files only
    assert client.bump(sid) == 4

    restored = client.track([client.stub.RestoreSandbox(pb.RestoreSandboxRequest(snapshot_id=snap.snapshot_id))
                             .sandbox])[0].sandbox_id
    assert client.read(restored, "/home/user/count.txt") == "3"  # the file as of the snapshot
    forks = client.track(client.stub.ForkSandbox(pb.ForkSandboxRequest(sandbox_id=sid, count=2)).sandboxes)
    a, b = (f.sandbox_id for f in forks)
    assert client.read(a, "/home/user/count.txt") == client.read(b, "/home/user/count.txt") == "4"

    # Divergence: each copy's writes are its own.
    for i, copy in enumerate((restored, a, b)):
        client.sh(copy, f"echo copy-{i} > /home/user/count.txt")
    assert client.bump(sid) == 5
    assert client.read(sid, "/home/user/count.txt") == "5"
    assert [client.read(c, "/home/user/count.txt").strip() for c in (restored, a, b)] == \
        ["copy-0", "copy-1", "copy-2"]
    for copy in (sid, restored, a, b):
        client.destroy(copy)


@requires_criu
def test_criu_memory_state_survives_snapshot_restore_and_fork(client):
    sid = client.create(backend="criu").sandbox_id
    client.start_counter(sid)
    assert [client.bump(sid), client.bump(sid)] == [1, 2]
    _pause_stops_cpu(client, sid, CGROUP_GROUP["criu"])
    # The killed busy loop had been re-parented to the container's init, which reaped it: no zombie.
    assert client.sh(sid, "sleep 0.2; ps -eo stat= | grep -c '^Z'")[1].strip() == "0"
    assert client.bump(sid) == 3

    snap = client.stub.SnapshotSandbox(pb.SnapshotSandboxRequest(sandbox_id=sid))
    assert snap.memory
    assert client.bump(sid) == 4

    restored = client.track([client.stub.RestoreSandbox(pb.RestoreSandboxRequest(snapshot_id=snap.snapshot_id))
                             .sandbox])[0].sandbox_id
    assert client.read(restored, "/home/user/count.txt") == "3"
    assert client.bump(restored) == 4  # the in-memory counter continued from 3, not from 0 or from 4

    forks = client.track(client.stub.ForkSandbox(pb.ForkSandboxRequest(sandbox_id=sid, count=2)).sandboxes)
    a, b = (f.sandbox_id for f in forks)
    # The parent was at 4: every copy (and the parent, which kept running) continues from 4 independently.
    assert [client.bump(a), client.bump(a), client.bump(b), client.bump(sid)] == [5, 6, 5, 5]
    assert [client.read(x, "/home/user/count.txt") for x in (a, b, sid, restored)] == ["6", "5", "5", "4"]
    for copy in (restored, a):  # the network namespace comes back as it was: loopback up
        assert client.run(copy, LOOPBACK_TCP)[1].strip() == "ok"

    # Hibernation: the processes leave the host entirely, and come back with their memory on first use.
    running_bytes = client.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=b)).sandbox.memory_bytes
    client.stub.PauseSandbox(pb.PauseSandboxRequest(sandbox_id=b, release_memory=True))
    info = client.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=b)).sandbox
    assert info.state == pb.SANDBOX_STATE_PAUSED and info.memory_released
    assert not Path(f"/sys/fs/cgroup/pids/{CGROUP_GROUP['criu']}/{b}").exists()  # no task of it is left
    assert info.memory_bytes < running_bytes
    # A snapshot or fork of a hibernated sandbox is taken from its images: it stays hibernated, and the
    # snapshot's restore and the fork's copy continue from its state.
    hib_snap = client.stub.SnapshotSandbox(pb.SnapshotSandboxRequest(sandbox_id=b)).snapshot_id
    hib_fork = client.track(client.stub.ForkSandbox(pb.ForkSandboxRequest(sandbox_id=b, count=1)).sandboxes)
    assert client.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=b)).sandbox.memory_released
    from_hib = client.track([client.stub.RestoreSandbox(pb.RestoreSandboxRequest(snapshot_id=hib_snap))
                             .sandbox])[0].sandbox_id
    assert [client.bump(from_hib), client.bump(hib_fork[0].sandbox_id)] == [6, 6]
    assert client.bump(b) == 6  # exec resumes it: restored from disk, continuing from 5
    assert not client.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=b)).sandbox.memory_released
    for copy in (sid, restored, a, b, from_hib, hib_fork[0].sandbox_id):
        client.destroy(copy)
