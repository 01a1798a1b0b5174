"""`k3 up`, `k3 status`, `k3 down` for the local fleet."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import urllib.error
import urllib.request

from services.cli import fleet
from services.cli.health_cmd import check
from services.runtime import metrics_scrape

# Summed over label sets; the `status` table shows those a member exports.
KEY_METRICS = ("k3_registry_connected", "k3_rpc_in_flight", "k3_gateway_in_flight", "k3_gateway_requests_total",
               "k3_gateway_failovers_total", "k3_router_healthy_clusters", "k3_admission_in_use",
               "k3_decode_running", "k3_decode_waiting", "k3_decode_pool_usage", "k3_decode_tokens_per_second",
               "k3_prefill_waiting", "k3_kvtransfer_handles_held")


def up(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k3 up", description="Start a local fleet of real processes.")
    parser.add_argument("--clusters", type=int, default=1)
    parser.add_argument("--etcd", default="", help="use this etcd (host:port) instead of starting one")
    parser.add_argument("--with", dest="with_services", action="append", default=[],
                        choices=fleet.OPTIONAL, help="also start an optional service")
    parser.add_argument("--lease-ttl-s", type=float, default=3.0)
    parser.add_argument("--no-smoke", action="store_true", help="skip the end-to-end request after start")
    parser.add_argument("--service-args", action="append", default=[], metavar='SERVICE="--flag value ..."',
                        help="extra flags for every instance of a service, e.g. decode=\"--max-running 32\"")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="how long to wait for the fleet")
    args = parser.parse_args(argv)
    if args.clusters < 1:
        parser.error("--clusters must be >= 1")
    extra: dict[str, list[str]] = {}
    for item in args.service_args:
        service, sep, flags = item.partition("=")
        if not sep or service not in fleet.CONTROL_PLANE + fleet.PER_CLUSTER + fleet.OPTIONAL:
            parser.error(f"--service-args {item!r}: write SERVICE=\"--flag value\" with a known service")
        extra.setdefault(service, []).extend(shlex.split(flags))
    try:
        state = fleet.up(args.clusters, args.etcd, tuple(args.with_services), args.lease_ttl_s, args.timeout_s,
                         extra)
    except RuntimeError as exc:
        print(f"k3 up failed: {exc}", file=sys.stderr)
        return 1
    print(f"etcd      {state.etcd_endpoint}")
    print_table(state)
    ok = args.no_smoke or smoke(state)
    print(f"\nstate in {fleet.home()}; `k3 status` to inspect, `k3 down` to stop")
    return 0 if ok else 1


def smoke(state: fleet.FleetState) -> bool:
    """One request end to end through the front door, so `k3 up` proves the fleet works."""
    gateway = next((m for m in state.members if m.service == "gateway"), None)
    if gateway is None or "http_address" not in gateway.extra:
        print("\nsmoke: no gateway in this fleet; every service answered its health check")
        return True
    body = json.dumps({"model": "nano", "messages": [{"role": "user", "content": "Hello, K3!"}],
                       "max_tokens": 16, "temperature": 0, "stream": False}).encode()
    request = urllib.request.Request(f"http://{gateway.extra['http_address']}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        print(f"\nsmoke: POST /v1/chat/completions FAILED: HTTP {exc.code} {exc.read().decode()[:500]}")
        return False
    except OSError as exc:
        print(f"\nsmoke: POST /v1/chat/completions FAILED: {exc}")
        return False
    choice = answer["choices"][0]
    print(f"\nsmoke: POST /v1/chat/completions -> {choice['finish_reason']}, "
          f"{answer['usage']['completion_tokens']} tokens from cluster {answer['system_fingerprint'][3:]}: "
          f"{choice['message']['content']!r}")
    return True


def status(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="k3 status").parse_args(argv)
    state = fleet.FleetState.load()
    if state is None:
        print("no local fleet (run `k3 up`)")
        return 1
    print(f"etcd      {state.etcd_endpoint} ({'up' if fleet.alive(state.etcd_pid) else 'DOWN'})")
    view = fleet.router_view(state)
    print("clusters  " + ("no router answers" if view is None else
                          ", ".join(f"{c} {'healthy' if view.get(c) else 'UNHEALTHY'}" for c in state.clusters)))
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
        samples = metrics_scrape.scrape(address, timeout=1)
    except metrics_scrape.ScrapeFailed:
        return "metrics unreachable"
    totals = {name: samples.total(name) for name in KEY_METRICS}
    return " ".join(f"{name.removeprefix('k3_')}={total:g}" for name, total in totals.items() if total is not None)
