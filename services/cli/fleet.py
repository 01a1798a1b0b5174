"""A local fleet of real K3 processes on loopback: etcd, the control plane, and per-cluster workers.

State lives in `$K3_HOME` (default `./.k3`): `fleet.json` (every process, its pid and addresses) and `logs/`.
Processes run in their own sessions, so the fleet outlives the `k3 up` that started it; `k3 down` drains
them with SIGTERM and kills what is left after the grace period.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.runtime.local_etcd import EtcdServer

CONTROL_PLANE = ("admission", "router", "gateway")
PER_CLUSTER = ("kvtransfer", "decode", "prefill")
OPTIONAL = ("sandbox", "trainer")
# Extra flags per service in the embedded default (the nano model on CPU).
DEFAULT_ARGS: dict[str, list[str]] = {
    "prefill": ["--model", "nano"],
    "decode": ["--model", "nano"],
    "gateway": ["--http-port", "0"],
}


def home() -> Path:
    return Path(os.environ.get("K3_HOME", ".k3")).resolve()


def available(service: str) -> bool:
    return importlib.util.find_spec(f"services.{service}.server") is not None


@dataclasses.dataclass
class Member:
    service: str
    cluster: str
    name: str
    pid: int
    address: str = ""
    metrics_address: str = ""
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FleetState:
    etcd_endpoint: str
    etcd_pid: int
    etcd_data: str
    members: list[Member]
    clusters: list[str]

    def save(self) -> None:
        home().mkdir(parents=True, exist_ok=True)
        (home() / "fleet.json").write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def load(cls) -> FleetState | None:
        path = home() / "fleet.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["members"] = [Member(**m) for m in data["members"]]
        return cls(**data)


def plan(clusters: int, with_services: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(service, cluster) pairs to start, control plane first, skipping services not built yet."""
    names = [f"c{i}" for i in range(clusters)]
    order = [(s, "global") for s in CONTROL_PLANE]
    order += [(s, c) for c in names for s in PER_CLUSTER]
    order += [(s, "global") for s in with_services if s in OPTIONAL]
    return [(s, c) for s, c in order if available(s)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_member(service: str, cluster: str, etcd_endpoint: str, extra_args: list[str],
                 ttl_s: float, token: str = "") -> subprocess.Popen:
    name = f"{service}-{cluster}"
    logs = home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ready = home() / "run" / f"{name}.json"
    ready.parent.mkdir(parents=True, exist_ok=True)
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "services.cli.main", "serve", service, "--port", "0", "--metrics-port", "0",
           "--cluster", cluster, "--instance", name, "--etcd-endpoints", etcd_endpoint,
           "--lease-ttl-s", str(ttl_s), "--ready-file", str(ready), *DEFAULT_ARGS.get(service, []), *extra_args]
    env = {**os.environ, "K3_AUTH_TOKEN": token} if token else None
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(logs / f"{name}.log", "ab"),
                            start_new_session=True, env=env)


def wait_ready(service: str, cluster: str, proc: subprocess.Popen, timeout: float) -> dict:
    ready = home() / "run" / f"{service}-{cluster}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        if proc.poll() is not None:
            log = (home() / "logs" / f"{service}-{cluster}.log").read_text()[-2000:]
            raise RuntimeError(f"{service} ({cluster}) exited with {proc.returncode}:\n{log}")
        time.sleep(0.05)
    raise RuntimeError(f"{service} ({cluster}) was not ready within {timeout:.0f}s")


def up(clusters: int = 1, etcd_endpoint: str = "", with_services: tuple[str, ...] = (), ttl_s: float = 3.0,
       timeout: float = 120.0) -> FleetState:
    existing = FleetState.load()
    if existing and any(alive(m.pid) for m in existing.members):
        raise RuntimeError(f"a local fleet is already running (state in {home()}); run `k3 down` first")
    etcd_pid, etcd_data = 0, ""
    if not etcd_endpoint:
        etcd = EtcdServer(home() / "etcd")
        etcd.start()
        etcd_endpoint, etcd_pid, etcd_data = etcd.endpoint, etcd.proc.pid, str(etcd.data_dir)
    state = FleetState(etcd_endpoint, etcd_pid, etcd_data, [], [f"c{i}" for i in range(clusters)])
    try:
        for service, cluster in plan(clusters, with_services):
            proc = start_member(service, cluster, etcd_endpoint, [], ttl_s)
            info = wait_ready(service, cluster, proc, timeout)
            extra = {k: v for k, v in info.items() if k not in ("address", "metrics_address", "pid")}
            state.members.append(Member(service, cluster, f"{service}-{cluster}", proc.pid, info["address"],
                                        info.get("metrics_address", ""), extra))
            state.save()
    except BaseException:
        state.save()
        down()
        raise
    state.save()
    return state


def down(grace_s: float = 15.0) -> int:
    """SIGTERM every member (they drain), then SIGKILL what is left; stop the fleet's etcd. Returns count."""
    state = FleetState.load()
    if state is None:
        return 0
    pids = [m.pid for m in reversed(state.members) if alive(m.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if state.etcd_pid and alive(state.etcd_pid):
        os.kill(state.etcd_pid, signal.SIGKILL)
    (home() / "fleet.json").unlink(missing_ok=True)
    return len(pids)
