"""Hostile tenants: each attack is contained by its limit, the host and a bystander sandbox are unaffected,
and the manager keeps serving. Attacks run on the namespace backend (the default one)."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from k3.v1 import sandbox_pb2 as pb
from tests.sandbox.conftest import CGROUP_GROUP, requires_criu, requires_namespace

pytestmark = requires_namespace
MIB = 1 << 20
both_backends = pytest.mark.parametrize("backend", ["namespace", pytest.param("criu", marks=requires_criu)])


@pytest.fixture(scope="module")
def bystander(client):
    """A peaceful sandbox that must keep working, with its state intact, through every attack."""
    sid = client.create().sandbox_id
    client.start_counter(sid)
    yield sid
    client.destroy(sid)


def _bystander_ok(client, sid: str, expected_before: int) -> None:
    assert client.bump(sid) == expected_before + 1


def _cgroup_file(backend: str, sid: str, controller: str, name: str) -> Path:
    return Path(f"/sys/fs/cgroup/{controller}/{CGROUP_GROUP[backend]}/{sid}/{name}")


def _cgroup_value(backend: str, sid: str, controller: str, name: str) -> int:
    return int(_cgroup_file(backend, sid, controller, name).read_text())


@both_backends
def test_fork_bomb_is_capped_by_pids_limit(client, bystander, backend):
    sid = client.create(backend=backend, limits={"pids": 32}).sandbox_id
    code, _, _ = client.run(sid, ["bash", "-c", ":(){ :|:& };:; sleep 60"], timeout_s=3)
    assert code == 124  # ran into its wall clock
    assert _cgroup_value(backend, sid, "pids", "pids.max") == 32
    assert _cgroup_value(backend, sid, "pids", "pids.current") <= 32
    assert int(_cgroup_file(backend, sid, "pids", "pids.events").read_text().split()[1]) > 0  # "max N"
    assert client.sh(sid, "echo alive")[1] == "alive\n"  # the timeout killed the whole bomb, not just sh
    client.destroy(sid)
    _bystander_ok(client, bystander, client.bump(bystander))


@both_backends
def test_memory_hog_is_oom_killed_inside_its_cgroup(client, bystander, backend):
    before = client.bump(bystander)
    sid = client.create(backend=backend, limits={"memory_bytes": 64 * MIB}).sandbox_id
    code, _, _ = client.run(sid, ["python3", "-c", "x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096])"])
    assert code in (137, 1), f"memory hog was not stopped (exit {code})"
    assert _cgroup_value(backend, sid, "memory", "memory.max_usage_in_bytes") <= 64 * MIB
    assert client.sh(sid, "echo still-serving")[1] == "still-serving\n"
    client.destroy(sid)
    _bystander_ok(client, bystander, before)


@both_backends
def test_disk_filler_hits_its_disk_limit_not_the_hosts(client, bystander, backend):
    sid = client.create(backend=backend, limits={"disk_bytes": 16 * MIB}).sandbox_id
    try:
        code, _, err = client.sh(sid, "dd if=/dev/zero of=/home/user/fill bs=1M count=200")
        assert code != 0 and "No space left" in err
        size = int(client.sh(sid, "stat -c %s /home/user/fill")[1])
        assert size <= 16 * MIB
        # The bytes landed on a filesystem no larger than the limit, so none reached the host's disks. (The
        # host's free space is no oracle here: other processes on the machine write to it meanwhile.)
        blocks, block_size = map(int, client.sh(sid, "stat -f -c '%b %S' /home/user/fill")[1].split())
        assert blocks * block_size <= 16 * MIB
    finally:
        client.destroy(sid)
    _bystander_ok(client, bystander, client.bump(bystander))


@both_backends
def test_network_is_unreachable_by_default(client, backend):
    # A listener on the host's loopback: a sandbox sharing the host network could connect to it.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    sid = client.create(backend=backend).sandbox_id
    probe = ("import socket\nfor host in ('127.0.0.1', '1.1.1.1', '10.0.0.1'):\n    s = socket.socket()\n"
             f"    s.settimeout(2)\n    try:\n        s.connect((host, {port}))\n        print(host, 'reached')\n"
             "    except OSError as e:\n        print(host, 'blocked', e.errno)\n")
    code, out, err = client.run(sid, ["python3", "-c", probe])
    listener.close()
    assert code == 0, err
    assert "reached" not in out and out.count("blocked") == 3
    assert client.sh(sid, "awk -F: 'NR > 2 {print $1}' /proc/net/dev")[1].split() == ["lo"]
    client.destroy(sid)


def test_writes_outside_the_root_do_not_reach_the_host(client, tmp_path):
    marker = f"escape-{uuid.uuid4().hex}"
    secret = tmp_path / "host-secret"
    secret.write_text("host secret")
    sid = client.create().sandbox_id
    script = (f"echo x > /etc/passwd; echo x > /usr/bin/{marker}; cd /home/user; "
              f"echo x > ../../../../../../tmp/{marker}; echo x > /proc/sysrq-trigger; "
              f"ln -s {secret} /home/user/link; ln -s /proc/1/root/{tmp_path} /home/user/link2; true")
    client.sh(sid, script)
    assert not Path(f"/usr/bin/{marker}").exists() and not Path(f"/tmp/{marker}").exists()
    assert "root:x:0:0" in Path("/etc/passwd").read_text()
    assert client.read(sid, f"/tmp/{marker}") == "x\n"  # the traversal landed inside the sandbox's own /tmp
    # The file API resolves paths inside the sandbox, so a planted symlink cannot read the host's files.
    for link in ("/home/user/link", "/home/user/link2/host-secret"):
        with pytest.raises(grpc.RpcError) as err:
            client.read(sid, link)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "host secret" not in err.value.details()
    client.destroy(sid)


def test_sandboxes_cannot_see_or_signal_each_other(client, bystander):
    marker = uuid.uuid4().hex
    victim = client.create().sandbox_id
    client.run(victim, ["bash", "-c", f"exec -a sleeper-{marker} sleep 600"], background=True)
    assert marker in client.sh(victim, "sleep 0.2; ps ax -o args=")[1]
    victim_pids = _cgroup_file("namespace", victim, "pids", "cgroup.procs").read_text().split()
    attacker = client.create().sandbox_id
    code, out, _ = client.sh(attacker, "ps ax -o pid=,args=")
    assert code == 0 and marker not in out
    assert len(out.splitlines()) <= 4  # bwrap's init, the anchor, sh, ps
    kills = "; ".join(f"kill -9 {p} 2>/dev/null && echo killed {p}" for p in victim_pids)
    assert "killed" not in client.sh(attacker, kills + "; true")[1]
    assert marker in client.sh(victim, "ps ax -o args=")[1]  # the victim's process is still alive
    _bystander_ok(client, bystander, client.bump(bystander))
    client.destroy(victim)
    client.destroy(attacker)


@both_backends
def test_process_ignoring_sigterm_is_killed_at_its_wall_clock(client, backend):
    sid = client.create(backend=backend, limits={"wall_clock_s": 30}).sandbox_id
    stubborn = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\ntime.sleep(600)\n")
    code, out, _ = client.run(sid, ["python3", "-c", stubborn], timeout_s=3)  # time enough to print "ready"
    assert (code, out) == (124, "ready\n")
    live = [ln for ln in client.sh(sid, "ps ax -o stat=,args=")[1].splitlines() if not ln.startswith("Z")]
    assert not any("python3" in ln for ln in live), live
    # The same stubborn process in the background does not stop the sandbox from being destroyed.
    client.run(sid, ["python3", "-c", stubborn], background=True)
    client.destroy(sid)
    assert not Path(f"/sys/fs/cgroup/pids/{CGROUP_GROUP[backend]}/{sid}").exists()


def test_manager_keeps_serving_after_the_attacks(client, sandbox_service, bystander):
    channel = grpc.insecure_channel(sandbox_service[0].address)
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="k3.v1.SandboxService"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    sid = client.create().sandbox_id
    assert client.sh(sid, "echo ok")[1] == "ok\n"
    assert os.path.ismount("/proc")  # the host's own mounts are untouched
    client.destroy(sid)
    listed = client.stub.ListSandboxes(pb.ListSandboxesRequest(tenant="t-test")).sandboxes
    assert [s.sandbox_id for s in listed] == [bystander]  # every attacker is gone, the bystander is not
