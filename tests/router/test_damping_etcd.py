"""Membership damping over a real etcd: the etcd process is frozen (SIGSTOP) past the lease TTL and resumed,
so it expires every lease at once although no cluster died. A damped router keeps routing every session to
its original primary throughout; an undamped control router (--mass-loss-fraction 0) sees the same etcd
drop every cluster, which its failback hold then makes visible. A real single-cluster SIGKILL afterwards
still fails over on the damped router, as before."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from k3.v1 import router_pb2, router_pb2_grpc
from services.runtime.client import sync_channel
from tests.router.test_router_service import route, wait_for
from tests.support.processes import ServiceProcess
from tests.support.repeated_calls import RepeatedCalls

CLUSTERS = ("c0", "c1", "c2")
SESSIONS = [f"damp-{i}" for i in range(60)]
FREEZE_S = 4.0  # past the lease TTL: 1 s requested, 2 s effective (etcd's minimum)


def fleet_view(stub) -> dict[str, tuple[bool, bool]]:
    """cluster -> (healthy, held_down)."""
    return {c.cluster.name: (c.healthy, c.held_down)
            for c in stub.GetFleet(router_pb2.GetFleetRequest(), timeout=5).clusters}


def route_answer(stub, i: int) -> tuple[str, str, bool]:
    session = SESSIONS[i % len(SESSIONS)]
    answer = route(stub, session)
    return session, answer.target.name, answer.failover


def test_frozen_etcd_is_damped_and_a_real_kill_still_fails_over(etcd_restartable, tmp_path):
    common = ["--port", "0", "--metrics-port", "-1", "--etcd-endpoints", etcd_restartable.endpoint,
              "--etcd-prefix", "/k3damp", "--lease-ttl-s", "1"]
    procs = {c: ServiceProcess(["serve", "tests.router.standin_decode", *common, "--cluster", c,
                                "--instance", f"{c}-d0"], tmp_path / c) for c in CLUSTERS}
    # Both routers hold a recovered cluster down for 30 s, so a cluster that left and came back shows.
    router_args = [*common, "--cluster", "global", "--slot-bits", "10", "--failback-hold-s", "30"]
    procs["damped"] = ServiceProcess(["serve", "router", *router_args, "--mass-loss-grace-s", "8"],
                                     tmp_path / "damped")
    procs["control"] = ServiceProcess(["serve", "router", *router_args, "--mass-loss-fraction", "0"],
                                      tmp_path / "control")
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.start(), procs.values()))
        damped, control = (router_pb2_grpc.RouterServiceStub(sync_channel(procs[n].address))
                           for n in ("damped", "control"))
        all_up = {c: (True, False) for c in CLUSTERS}
        wait_for(lambda: fleet_view(damped) == all_up == fleet_view(control), 15, "both routers to see 3")
        primaries = {s: route(damped, s).primary.name for s in SESSIONS}
        assert set(primaries.values()) == set(CLUSTERS)

        with RepeatedCalls(partial(route_answer, damped), threads=2) as load:
            os.kill(etcd_restartable.proc.pid, signal.SIGSTOP)
            time.sleep(FREEZE_S)
            os.kill(etcd_restartable.proc.pid, signal.SIGCONT)
            # The control router saw clusters expire and come back (so now holds them down): the fault is
            # real. (How many: every one whose old lease etcd revoked before its instance re-registered.)
            wait_for(lambda: any(held for _, held in fleet_view(control).values()), 15,
                     "the undamped router to see the lease expiry")
            wait_for(lambda: fleet_view(damped) == all_up, 10, "instances to re-register")
            time.sleep(1.0)
        expired = sorted(c for c, (_, held) in fleet_view(control).items() if held)
        print(f"etcd frozen {FREEZE_S} s: the undamped router saw {expired} expire; the damped one answered "
              f"{len(load.answers)} routes meanwhile")
        assert load.errors == [] and len(load.answers) > 50
        wrong = [(s, t, f) for s, t, f in load.answers if t != primaries[s] or f]
        assert wrong == [], f"{len(wrong)} of {len(load.answers)} routes left their primary: {wrong[:5]}"
        assert fleet_view(damped) == all_up  # nothing was held down: no cluster ever left its view

        # A real single-cluster death takes the normal path: failover within the lease TTL + 1 s.
        procs["c0"].signal(signal.SIGKILL)
        killed, noticed = time.monotonic(), {}
        while len(noticed) < 2 and time.monotonic() - killed < 2 + 1:  # effective TTL + 1 s
            for name, stub in (("damped", damped), ("undamped", control)):
                if name not in noticed and not fleet_view(stub)["c0"][0]:
                    noticed[name] = round(time.monotonic() - killed, 2)
            time.sleep(0.02)
        print(f"seconds until the SIGKILLed cluster left: {noticed}")
        assert noticed.keys() == {"damped", "undamped"}
        for session, primary in primaries.items():
            answer = route(damped, session)
            assert answer.failover == (primary == "c0")
            assert answer.target.name == (answer.backup.name if primary == "c0" else primary)
    finally:
        for proc in procs.values():
            proc.kill()
