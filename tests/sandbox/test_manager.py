"""Manager housekeeping in-process (real namespace sandboxes): idle auto-pause, TTL destroy, periodic
snapshots with retention, snapshots surviving a manager restart, and limit resolution as a property."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.sandbox.backends.base import ExecSpec, collect
from services.sandbox.backends.criu import CriuBackend
from services.sandbox.backends.criu_dump import DESCRIPTORS, make_images_dir
from services.sandbox.backends.namespace import NamespaceBackend
from services.sandbox.config import SandboxConfig
from services.sandbox.errors import BackendFailure, InvalidRequest, NotFound
from services.sandbox.limits import _FLOORS, LimitRequest, resolve_limits
from services.sandbox.manager import SandboxManager
from tests.sandbox.conftest import CGROUP_GROUP, leaked_mounts, requires_criu, requires_namespace


@pytest.fixture
async def manager(tmp_path):
    config = SandboxConfig(root_dir=str(tmp_path), keep_periodic_snapshots=2)
    backends = {"namespace": NamespaceBackend(tmp_path / "backends" / "namespace"),
                "criu": CriuBackend(tmp_path / "backends" / "criu")}
    mgr = SandboxManager(config, backends)
    yield mgr
    await mgr.close()
    assert leaked_mounts(tmp_path) == []


def _age(mgr: SandboxManager, sid: str, seconds: float) -> None:
    """Pretends the sandbox was last used `seconds` ago (instead of sleeping that long)."""
    mgr.sandboxes[sid].last_active = time.monotonic() - seconds


async def _sh(mgr: SandboxManager, sid: str, script: str) -> str:
    return (await collect(mgr.exec(sid, ExecSpec(["sh", "-c", script])))).stdout.decode()


@requires_namespace
async def test_idle_sandbox_is_paused_then_destroyed_and_use_resumes_it(manager):
    sb = await manager.create("base", "t", LimitRequest(), idle_pause_s=60, ttl_s=600)
    _age(manager, sb.sandbox_id, 30)
    await manager.housekeep()
    assert not sb.paused  # not idle long enough yet
    _age(manager, sb.sandbox_id, 61)
    await manager.housekeep()
    assert sb.paused
    assert await _sh(manager, sb.sandbox_id, "echo back") == "back\n"  # using it resumes it
    assert not sb.paused
    _age(manager, sb.sandbox_id, 601)
    await manager.housekeep()
    with pytest.raises(NotFound, match="ttl"):
        manager.get(sb.sandbox_id)


@requires_criu
async def test_idle_criu_sandbox_is_hibernated_and_wakes_with_its_memory(manager):
    sb = await manager.create("base", "t", LimitRequest(), backend="criu", idle_pause_s=60)
    await collect(manager.exec(sb.sandbox_id, ExecSpec(["sh", "-c", "echo $$ > /tmp/pid; exec sleep 600"],
                                                         background=True)))
    pid_before = await _sh(manager, sb.sandbox_id, "sleep 0.2; cat /tmp/pid")
    _age(manager, sb.sandbox_id, 61)
    await manager.housekeep()
    assert sb.handle.hibernated and sb.paused
    # The same process (same pid in its namespace, still sleeping) is back after the wake-up.
    assert await _sh(manager, sb.sandbox_id, f"ps -o args= -p {pid_before.strip()}") == "sleep 600\n"
    assert not sb.handle.hibernated and not sb.paused


@requires_namespace
async def test_periodic_snapshots_keep_the_newest_and_survive_a_restart(manager, tmp_path):
    sb = await manager.create("base", "t", LimitRequest(), snapshot_interval_s=5)
    for i in range(4):
        await _sh(manager, sb.sandbox_id, f"echo {i} > /home/user/step")
        sb.next_snapshot = 0  # due now
        await manager.housekeep()
    assert len(sb.snapshots) == 2 and len(list((tmp_path / "snapshots").iterdir())) == 2
    newest = sb.snapshots[-1]

    reborn = SandboxManager(manager.config, manager.backends)  # a restarted manager reads the records back
    assert set(reborn.snapshots) == set(sb.snapshots)
    restored, _ = await reborn.restore(newest)
    assert await _sh(reborn, restored.sandbox_id, "cat /home/user/step") == "3\n"
    await reborn.destroy(restored.sandbox_id)


@given(memory=st.integers(0, 1 << 40), pids=st.integers(0, 10_000), cpu=st.integers(0, 20_000))
def test_limits_resolve_to_defaults_or_reject_out_of_range(memory, pids, cpu):
    config = SandboxConfig()
    req = LimitRequest(memory_bytes=memory, pids=pids, cpu_millis=cpu)
    in_range = all(v == 0 or _FLOORS[k] <= v <= getattr(config, f"max_{k}")
                   for k, v in (("memory_bytes", memory), ("pids", pids), ("cpu_millis", cpu)))
    if not in_range:
        with pytest.raises(InvalidRequest):
            resolve_limits(req, config)
        return
    lim = resolve_limits(req, config)
    assert lim.memory_bytes == (memory or config.default_memory_bytes)
    assert lim.pids == (pids or config.default_pids)
    assert lim.cpu_millis == (cpu or config.default_cpu_millis)
    assert lim.disk_bytes == config.default_disk_bytes and not lim.network


def test_firecracker_diff_layering_keeps_parent_pages_and_overwrites_dirty_ones(tmp_path: Path):
    """The memory-image merge behind Diff snapshots, on real sparse files (Firecracker itself cannot run
    here): the result must equal the parent with exactly the diff's data extents overwritten."""
    from services.sandbox.backends.firecracker import _copy_data_extents

    page = 4096
    parent = bytes((i * 7) % 251 for i in range(64 * page))
    (tmp_path / "merged").write_bytes(parent)
    dirty = {3: b"\x11" * page, 40: b"\x22" * (2 * page)}
    with open(tmp_path / "diff", "wb") as f:
        f.truncate(len(parent))  # a sparse file: holes everywhere except the dirty pages
        for index, data in dirty.items():
            f.seek(index * page)
            f.write(data)
    _copy_data_extents(tmp_path / "diff", tmp_path / "merged")
    expected = bytearray(parent)
    for index, data in dirty.items():
        expected[index * page:index * page + len(data)] = data
    assert (tmp_path / "merged").read_bytes() == bytes(expected)


@pytest.mark.parametrize("backend", [pytest.param("namespace", marks=requires_namespace),
                                     pytest.param("criu", marks=requires_criu)])
async def test_a_restarted_manager_reaps_sandboxes_left_by_a_crashed_one(manager, tmp_path, backend):
    sb = await manager.create("base", "t", LimitRequest(), backend=backend)
    await collect(manager.exec(sb.sandbox_id, ExecSpec(["sleep", "600"], background=True)))
    assert leaked_mounts(tmp_path)
    # The first manager "crashed": a new one on the same root finds its sandbox and tears it down.
    fresh = {"namespace": NamespaceBackend, "criu": CriuBackend}[backend](tmp_path / "backends" / backend)
    successor = SandboxManager(manager.config, {backend: fresh})
    await successor.start()
    await successor.close()
    assert leaked_mounts(tmp_path) == []
    for controller in ("unified", "memory", "pids"):
        assert not Path(f"/sys/fs/cgroup/{controller}/{CGROUP_GROUP[backend]}/{sb.sandbox_id}").exists()


@requires_criu
async def test_criu_fork_of_a_state_criu_cannot_dump_fails_cleanly(manager, tmp_path):
    """An established TCP connection (here over the sandbox's loopback) is state CRIU will not dump without
    --tcp-established. The fork fails with CRIU's reason, the parent keeps running, and the copies (whose
    `runc restore` had already started, waiting for the images) leave no container, mount or cgroup behind."""
    sb = await manager.create("base", "t", LimitRequest(), backend="criu")
    hold_connection = ("import socket, time; s = socket.create_server(('127.0.0.1', 0)); "
                       "c = socket.create_connection(s.getsockname()); a = s.accept(); time.sleep(600)")
    await collect(manager.exec(sb.sandbox_id, ExecSpec(["python3", "-c", hold_connection], background=True)))
    await _sh(manager, sb.sandbox_id, "sleep 0.3")
    with pytest.raises(BackendFailure, match="criu dump failed"):
        await manager.fork(sb.sandbox_id, 2)
    assert list(manager.sandboxes) == [sb.sandbox_id] and not sb.paused
    assert await _sh(manager, sb.sandbox_id, "echo alive") == "alive\n"
    criu_root = tmp_path / "backends" / "criu"
    assert sorted(p.name for p in criu_root.glob("sbx-*")) == [sb.sandbox_id]
    assert [m for m in leaked_mounts(tmp_path) if sb.sandbox_id not in m] == []
    assert sorted(p.name for p in Path(f"/sys/fs/cgroup/memory/{CGROUP_GROUP['criu']}").iterdir()
                  if p.is_dir()) == [sb.sandbox_id]


TCP_COUNTER = ("import socket\nn = 0\nserver = socket.create_server(('127.0.0.1', 7000))\nwhile True:\n"
               "    conn, _ = server.accept()\n    n += 1\n    conn.sendall(str(n).encode())\n    conn.close()\n")
TCP_BUMP = ["python3", "-c", "import socket, time\nfor _ in range(100):\n    try:\n"
            "        print(socket.create_connection(('127.0.0.1', 7000)).recv(16).decode())\n        break\n"
            "    except ConnectionRefusedError:\n        time.sleep(0.05)\n"]  # waits for the server to listen


@requires_criu
async def test_criu_fork_of_a_tcp_server_keeps_serving_in_every_copy(manager):
    """A listening TCP socket on the sandbox's loopback is forked with its process (this needs CRIU built by
    .ci/install-sandbox-deps.sh: stock 4.1.1 cannot dump inet sockets on Linux 6.16+) and loopback is up in
    the copies: each copy's server continues the parent's count on its own."""
    sb = await manager.create("base", "t", LimitRequest(), backend="criu")
    await manager.write_file(sb.sandbox_id, "/home/user/tcp_counter.py", TCP_COUNTER.encode(), 0o644)
    await collect(manager.exec(sb.sandbox_id, ExecSpec(["python3", "/home/user/tcp_counter.py"], background=True)))
    assert (await collect(manager.exec(sb.sandbox_id, ExecSpec(TCP_BUMP)))).stdout == b"1\n"
    copies, _ = await manager.fork(sb.sandbox_id, 2)
    runs = [(c.sandbox_id, await collect(manager.exec(c.sandbox_id, ExecSpec(TCP_BUMP)))) for c in copies]
    assert [r.stdout for _, r in runs] == [b"2\n", b"2\n"], [r.stderr[-300:] for _, r in runs]
    assert (await collect(manager.exec(sb.sandbox_id, ExecSpec(TCP_BUMP)))).stdout == b"2\n"


@requires_criu
async def test_reaper_releases_a_restore_left_waiting_by_a_crashed_fork(manager):
    """A fork's `runc restore` waits on its images' descriptors.json FIFO until the manager feeds it; if the
    manager died there, the next one's reaper must give it EOF (so runc fails and cleans up) rather than
    leave it blocked forever. `cat` stands in for runc here: it blocks in open() on the FIFO the same way."""
    backend = manager.backends["criu"]
    images = backend.scratch / "fork-sbx-0000000000000000-x" / "images-0"
    backend.scratch.mkdir(exist_ok=True)
    make_images_dir(images, descriptors_fifo=True)
    waiter = subprocess.Popen(["cat", str(images / DESCRIPTORS)], stdout=subprocess.PIPE)
    try:
        time.sleep(0.2)
        assert waiter.poll() is None  # blocked, as runc would be
        await backend.reap_orphans()
        assert waiter.wait(timeout=10) == 0 and waiter.stdout.read() == b""
    finally:
        waiter.kill()
        waiter.wait()
    assert not backend.scratch.exists()
