"""`k3 up`, `k3 status`, `k3 down` for the local fleet."""

from __future__ import annotations

import argparse
import json
import urllib.request

from services.cli import fleet
from services.cli.health_cmd import check

KEY_METRICS = ("k3_rpc_in_flight", "k3_decode_running", "k3_decode_pool_usage", "k3_registry_connected")


def up(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k3 up", description="Start a local fleet of real processes.")
    parser.add_argument("--clusters", type=int, default=1)
    parser.add_argument("--etcd", default="", help="use this etcd (host:port) instead of starting one")
    parser.add_argument("--with", dest="with_services", action="append", default=[],
                        choices=fleet.OPTIONAL, help="also start an optional service")
    parser.add_argument("--lease-ttl-s", type=float, default=3.0)
    parser.add_argument("--no-smoke", action="store_true", help="skip the end-to-end request after start")
    args = parser.parse_args(argv)
    if args.clusters < 1:
        parser.error("--clusters must be >= 1")
    state = fleet.up(args.clusters, args.etcd, tuple(args.with_services), args.lease_ttl_s)
    print(f"etcd      {state.etcd_endpoint}")
    print_table(state)
    if not args.no_smoke:
        smoke(state)
    print(f"\nstate in {fleet.home()}; `k3 status` to inspect, `k3 down` to stop")
    return 0


def smoke(state: fleet.FleetState) -> None:
    """One request end to end through the front door, so `k3 up` proves the fleet works."""
    gateway = next((m for m in state.members if m.service == "gateway"), None)
    if gateway is None or "http_address" not in gateway.extra:
        print("\nsmoke: no gateway yet; every service answered its health check")
        return
    body = json.dumps({"model": "nano", "messages": [{"role": "user", "content": "Hello, K3!"}],
                       "max_tokens": 16, "temperature": 0, "stream": False}).encode()
    request = urllib.request.Request(f"http://{gateway.extra['http_address']}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = json.loads(reply.read())
    choice = answer["choices"][0]
    print(f"\nsmoke: POST /v1/chat/completions -> {choice['finish_reason']}, "
          f"{answer['usage']['completion_tokens']} tokens: {choice['message']['content']!r}")


def status(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="k3 status").parse_args(argv)
    state = fleet.FleetState.load()
    if state is None:
        print("no local fleet (run `k3 up`)")
        return 1
    print(f"etcd      {state.etcd_endpoint} ({'up' if fleet.alive(state.etcd_pid) else 'DOWN'})")
    print_table(state, with_metrics=True)
    return 0


def down(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k3 down")
    parser.add_argument("--grace-s", type=float, default=15.0)
    args = parser.parse_args(argv)
    print(f"stopped {fleet.down(args.grace_s)} processes")
    return 0


def print_table(state: fleet.FleetState, with_metrics: bool = False) -> None:
    header = f"{'service':<11}{'cluster':<9}{'pid':>8}  {'address':<22}{'health':<13}"
    print(header + ("metrics" if with_metrics else "metrics endpoint"))
    for m in state.members:
        health = check(m.address) if fleet.alive(m.pid) else "DEAD"
        tail = scrape(m.metrics_address) if with_metrics and health != "DEAD" else m.metrics_address
        print(f"{m.service:<11}{m.cluster:<9}{m.pid:>8}  {m.address:<22}{health:<13}{tail}")


def scrape(address: str) -> str:
    if not address:
        return ""
    try:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=1).read().decode()
    except OSError:
        return "metrics unreachable"
    values = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in KEY_METRICS and not line.startswith("#"):
            values[name.removeprefix("k3_")] = values.get(name.removeprefix("k3_"), 0.0) + float(line.split()[-1])
    return " ".join(f"{k}={v:g}" for k, v in values.items())
