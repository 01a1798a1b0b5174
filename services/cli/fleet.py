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
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from k3.v1 import router_pb2, router_pb2_grpc
from services.runtime.client import sync_channel
from services.runtime.local_etcd import EtcdServer

CONTROL_PLANE = ("admission", "router", "gateway")
PER_CLUSTER = ("kvtransfer", "decode", "prefill")
OPTIONAL = ("sandbox", "trainer")
# Extra flags per service in the embedded default (the nano model on CPU). A cluster is disaggregated
# (prefill -> kvtransfer -> decode), so the router counts it healthy only while all three are alive.
# The nano demo's prompts are far shorter than K3's 512-token hash blocks: 64-token blocks let multi-turn
# sessions hit the prefix cache. Gateway, router and workers must agree on the block size.
NANO_HASH_BLOCK = ["--hash-block-tokens", "64"]
DEFAULT_ARGS: dict[str, list[str]] = {
    "prefill": ["--model", "nano", *NANO_HASH_BLOCK],
    "decode": ["--model", "nano", *NANO_HASH_BLOCK],
    "router": ["--required-instances", "decode:1,prefill:1,kvtransfer:1", *NANO_HASH_BLOCK],
    "gateway": ["--http-port", "0", "--model", "nano", *NANO_HASH_BLOCK],
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
    lease_ttl_s: float = 3.0
    # Flags added per service on top of DEFAULT_ARGS (kept so `k3 scale` starts members alike).
    extra_args: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def args_for(self, service: str) -> list[str]:
        return self.extra_args.get(service, [])

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
    # A zombie (exited, not yet reaped by its parent) is not alive.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def member_name(service: str, cluster: str, index: int) -> str:
    return f"{service}-{cluster}-{index}"


def start_member(name: str, service: str, cluster: str, etcd_endpoint: str, extra_args: list[str],
                 ttl_s: float, token: str = "") -> subprocess.Popen:
    logs = home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ready = home() / "run" / f"{name}.json"
    ready.parent.mkdir(parents=True, exist_ok=True)
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "services.cli.main", "serve", service, "--port", "0", "--metrics-port", "0",
           "--cluster", cluster, "--instance", name, "--etcd-endpoints", etcd_endpoint,
           "--lease-ttl-s", str(ttl_s), "--ready-file", str(ready), *DEFAULT_ARGS.get(service, []), *extra_args]
    # A CPU fleet shares few cores among many torch processes: one OpenMP thread each unless told otherwise.
    env = {"OMP_NUM_THREADS": "1", **os.environ, **({"K3_AUTH_TOKEN": token} if token else {})}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(logs / f"{name}.log", "ab"),
                            start_new_session=True, env=env)


def wait_ready(name: str, proc: subprocess.Popen, timeout: float) -> dict:
    ready = home() / "run" / f"{name}.json"
    deadline = time.monotonic() + timeout
    while True:
        if ready.exists():
            return json.loads(ready.read_text())
        if proc.poll() is not None:
            log = (home() / "logs" / f"{name}.log").read_text()[-2000:]
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{name} was not ready within {timeout:.0f}s")


def up(clusters: int = 1, etcd_endpoint: str = "", with_services: tuple[str, ...] = (), ttl_s: float = 3.0,
       timeout: float = 180.0, extra_args: dict[str, list[str]] | None = None) -> FleetState:
    """Start etcd (unless given) and every member at once, then wait until each is serving and the router
    counts every cluster healthy. `extra_args` adds flags per service (after the defaults, so they win)."""
    existing = FleetState.load()
    if existing and any(alive(m.pid) for m in existing.members):
        raise RuntimeError(f"a local fleet is already running (state in {home()}); run `k3 down` first")
    etcd_pid, etcd_data = 0, ""
    if not etcd_endpoint:
        # A fresh etcd each time: stale registrations of an earlier fleet must not linger.
        shutil.rmtree(home() / "etcd", ignore_errors=True)
        etcd = EtcdServer(home() / "etcd", detach=True)
        etcd.start()
        etcd_endpoint, etcd_pid, etcd_data = etcd.endpoint, etcd.proc.pid, str(etcd.data_dir)
    state = FleetState(etcd_endpoint, etcd_pid, etcd_data, [], [f"c{i}" for i in range(clusters)], ttl_s,
                       extra_args or {})
    # Everything starts in parallel (model loads overlap); the peers find each other through etcd.
    launched = [(service, cluster, member_name(service, cluster, 0))
                for service, cluster in plan(clusters, with_services)]
    procs = {}
    try:
        for service, cluster, name in launched:
            procs[name] = start_member(name, service, cluster, etcd_endpoint, state.args_for(service), ttl_s)
            state.members.append(Member(service, cluster, name, procs[name].pid))
        state.save()
        deadline = time.monotonic() + timeout
        for member in state.members:
            fill_member(member, wait_ready(member.name, procs[member.name], deadline - time.monotonic()))
        state.save()
        wait_fleet_healthy(state, deadline - time.monotonic())
    except BaseException:
        state.save()
        down()
        raise
    return state


def fill_member(member: Member, info: dict) -> None:
    member.address, member.metrics_address = info["address"], info.get("metrics_address", "")
    member.extra = {k: v for k, v in info.items()
                    if k not in ("address", "metrics_address", "pid", "service", "instance")}


def router_view(state: FleetState, timeout: float = 1.0) -> dict[str, bool] | None:
    """Cluster -> healthy as the first live router sees it; None when no router answers."""
    for router in (m for m in state.members if m.service == "router" and m.address and alive(m.pid)):
        with sync_channel(router.address) as channel:
            try:
                reply = router_pb2_grpc.RouterServiceStub(channel).GetFleet(router_pb2.GetFleetRequest(),
                                                                            timeout=timeout)
            except grpc.RpcError:
                continue
        return {c.cluster.name: c.healthy and not c.held_down for c in reply.clusters}
    return None


def wait_fleet_healthy(state: FleetState, timeout: float) -> None:
    """Until the router routes to every cluster (all members registered, leases live, table built)."""
    if not any(m.service == "router" for m in state.members):
        return
    deadline = time.monotonic() + timeout
    view = None
    while time.monotonic() < deadline:
        view = router_view(state)
        if view is not None and all(view.get(c) for c in state.clusters):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the router did not count every cluster healthy within {timeout:.0f}s (sees {view})")


def add_member(state: FleetState, service: str, cluster: str, timeout: float = 180.0) -> Member:
    taken = {m.name for m in state.members}
    index = next(i for i in range(len(taken) + 1) if member_name(service, cluster, i) not in taken)
    name = member_name(service, cluster, index)
    proc = start_member(name, service, cluster, state.etcd_endpoint, state.args_for(service), state.lease_ttl_s)
    member = Member(service, cluster, name, proc.pid)
    fill_member(member, wait_ready(name, proc, timeout))
    state.members.append(member)
    state.save()
    return member


def stop_member(state: FleetState, member: Member, grace_s: float = 15.0) -> None:
    terminate([member.pid], grace_s)
    state.members.remove(member)
    state.save()


def scale(service: str, replicas: int, cluster: str) -> list[str]:
    """Start or drain instances of `service` in `cluster` until it has `replicas`; returns what changed."""
    state = FleetState.load()
    if state is None:
        raise RuntimeError("no local fleet (run `k3 up`)")
    if cluster not in state.clusters and cluster != "global":
        raise RuntimeError(f"unknown cluster {cluster!r}; the fleet has {', '.join(state.clusters)}")
    current = [m for m in state.members if m.service == service and m.cluster == cluster and alive(m.pid)]
    changes = []
    while len(current) < replicas:
        member = add_member(state, service, cluster)
        current.append(member)
        changes.append(f"started {member.name} at {member.address}")
    while len(current) > replicas:
        member = current.pop()
        stop_member(state, member)
        changes.append(f"drained {member.name}")
    return changes


def terminate(pids: list[int], grace_s: float) -> None:
    """SIGTERM (the services drain), then SIGKILL whatever outlives the grace period."""
    pids = [p for p in pids if alive(p)]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def down(grace_s: float = 15.0) -> int:
    """SIGTERM every member (they drain), then SIGKILL what is left; stop the fleet's etcd. Returns count."""
    state = FleetState.load()
    if state is None:
        return 0
    pids = [m.pid for m in reversed(state.members) if alive(m.pid)]
    terminate(pids, grace_s)
    if state.etcd_pid and alive(state.etcd_pid):
        os.kill(state.etcd_pid, signal.SIGKILL)
    (home() / "fleet.json").unlink(missing_ok=True)
    return len(pids)
