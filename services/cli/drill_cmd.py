"""`k3 drill KIND`: generate multi-turn load, inject a real fault, watch, report, check SLOs.

    k3 drill kill-cluster --cluster c1 --sessions 300 \
        --slo 'errors<=0' --slo 'detect_s<=4' --slo 'reprefill_ratio<=1.2'

Against the local fleet by default; `--kube` targets a Kubernetes fleet (pods deleted through the API;
give `--gateway` and `--router` addresses reachable from here, e.g. port-forwards). Exits 1 when an SLO fails.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from services.cli import fleet
from services.cli.drill import report
from services.cli.drill.faults import KINDS, KubeFault, LocalFault
from services.cli.drill.load import LoadGenerator, LoadSpec
from services.cli.drill.observe import FleetObserver
from services.cli.drill.slo import parse_slo
from services.runtime.metrics_scrape import ScrapeFailed, scrape


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3 drill", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--cluster", default="", help="the cluster to hit (default: the last one)")
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--fault-after-s", type=float, default=3.0, help="inject this long after load starts")
    parser.add_argument("--fault-after-requests", type=int, default=0,
                        help="...and once the target cluster served this many requests (its sessions then have "
                             "history to re-prefill elsewhere)")
    parser.add_argument("--duration-s", type=float, default=5.0, help="how long a partition/throttle lasts")
    parser.add_argument("--slo", action="append", default=[], help="e.g. errors<=0, detect_s<=4")
    parser.add_argument("--report-dir", default="drill-report")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kube", action="store_true", help="target a Kubernetes fleet")
    parser.add_argument("--namespace", default="k3")
    parser.add_argument("--gateway", default="", help="gateway HTTP host:port (required with --kube)")
    parser.add_argument("--router", default="", help="router gRPC host:port (required with --kube)")
    parser.add_argument("--clusters", default="", help="comma-separated cluster names (with --kube)")
    parser.add_argument("--api-key", default="")
    args = parser.parse_args(argv)
    try:
        args.slos = [parse_slo(s, report.SUMMARY_METRICS) for s in args.slo]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.kube:
        from kubernetes import config as kube_config

        if not (args.gateway and args.router and args.clusters and args.cluster):
            raise SystemExit("k3 drill --kube needs --gateway, --router, --clusters and --cluster")
        kube_config.load_kube_config()
        from kubernetes import client

        clusters = args.clusters.split(",")
        fault = KubeFault(args.kind, client.ApiClient(), args.namespace, args.cluster, args.duration_s)
        gateway, router, gateway_metrics = args.gateway, args.router, ""
    else:
        state = fleet.FleetState.load()
        if state is None:
            raise SystemExit("k3 drill: no local fleet (run `k3 up --clusters 3` first)")
        clusters = state.clusters
        gw = next((m for m in state.members if m.service == "gateway" and fleet.alive(m.pid)), None)
        rt = next((m for m in state.members if m.service == "router" and fleet.alive(m.pid)), None)
        if gw is None or rt is None:
            raise SystemExit("k3 drill: the local fleet needs a live gateway and router")
        gateway, router, gateway_metrics = gw.extra["http_address"], rt.address, gw.metrics_address
        fault = LocalFault(args.kind, state, args.cluster or clusters[-1], args.duration_s)
    return asyncio.run(run(args, fault, gateway, router, clusters, gateway_metrics))


async def run(args: argparse.Namespace, fault, gateway: str, router: str, clusters: list[str],
              gateway_metrics: str = "") -> int:
    spec = LoadSpec(args.sessions, args.turns, args.concurrency, args.max_tokens, seed=args.seed)
    load = LoadGenerator(gateway, spec, api_key=args.api_key)
    observer = FleetObserver(router, args.api_key)
    # Where the router pins each session now: the fault should move exactly the target's sessions, each to
    # its pre-assigned backup.
    placements = await observer.placements(load.session_ids())
    failovers_before = scrape_failovers(gateway_metrics)
    stop = asyncio.Event()
    t0 = time.monotonic()
    load_task = asyncio.create_task(load.run(t0))
    watch_task = asyncio.create_task(observer.watch(t0, stop))
    progress_task = asyncio.create_task(progress(load, spec, stop))

    await asyncio.sleep(args.fault_after_s)
    while served_by(load, fault.target_cluster) < args.fault_after_requests and not load_task.done():
        await asyncio.sleep(0.05)
    injected = await fault.inject()
    fault_at = time.monotonic() - t0
    print(f"\n>>> t={fault_at:.2f}s {injected}", file=sys.stderr)
    await asyncio.sleep(args.duration_s)
    await fault.heal()
    records = await load_task
    stop.set()
    await asyncio.gather(watch_task, progress_task)

    # A lost worker takes its cluster out only when it was the last of its kind (the router's requirement).
    detect_at = (observer.first_unhealthy(fault.target_cluster, fault_at)
                 if args.kind in ("kill-cluster", "kill-worker") else None)
    summary = report.summarize(records, fault_at, fault.target_cluster, clusters, detect_at, args.sessions,
                               placements)
    summary["router_unhealthy_s"] = observer.unhealthy_seconds(fault_at)
    summary["healthy_clusters_min"] = observer.min_healthy(fault_at)
    failovers_after = scrape_failovers(gateway_metrics)
    if failovers_before is not None and failovers_after is not None:
        summary["gateway_failovers"] = {k: v - failovers_before.get(k, 0) for k, v in failovers_after.items()}
    slo_results = [slo.check(summary) for slo in args.slos]
    meta = {"fault": args.kind, "cluster": fault.target_cluster, "injected": injected, "fault_at_s": fault_at,
            "sessions": args.sessions, "turns": args.turns, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "clusters": clusters, "duration_s": time.monotonic() - t0}
    page = report.write(Path(args.report_dir), meta, summary, slo_results, records, placements)
    print_summary(summary, slo_results)
    print(f"report: {page} and {page.with_suffix('.json')}")
    return 0 if all(s["passed"] for s in slo_results) else 1


def served_by(load: LoadGenerator, cluster: str) -> int:
    return sum(1 for r in load.records if r.end is not None and r.ok and cluster in r.clusters)


def scrape_failovers(metrics_address: str) -> dict[str, float] | None:
    """The gateway's k3_gateway_failovers_total by stage, or None when its metrics are not reachable."""
    if not metrics_address:
        return None
    try:
        samples = scrape(metrics_address, timeout=2)
    except ScrapeFailed:
        return None
    found: dict[str, float] = {}
    for labels, value in samples.series("k3_gateway_failovers_total"):
        found[labels["stage"]] = found.get(labels["stage"], 0.0) + value
    return found


async def progress(load: LoadGenerator, spec: LoadSpec, stop: asyncio.Event) -> None:
    """A progress bar and a one-line live table of requests, errors, TTFT and where requests land."""
    total = spec.sessions * spec.turns
    tty = sys.stderr.isatty()
    while not stop.is_set():
        done = [r for r in load.records if r.end is not None]
        errors = sum(1 for r in done if not r.ok)
        ttfts = [r.ttft for r in done if r.ok and r.ttft is not None][-200:]
        p99 = report.percentile(ttfts, 0.99)
        per_cluster: dict[str, int] = {}
        for r in done[-300:]:
            if r.clusters:
                per_cluster[r.clusters[-1]] = per_cluster.get(r.clusters[-1], 0) + 1
        frac = min(1.0, len(done) / total) if total else 1.0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = (f"[{bar}] {100 * frac:5.1f}% requests={len(done)} errors={errors} "
                f"p99_ttft={'-' if p99 is None else f'{1000 * p99:.0f}ms'} recent="
                + ",".join(f"{c}:{n}" for c, n in sorted(per_cluster.items())))
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
        try:
            await asyncio.wait_for(stop.wait(), 0.5 if tty else 2.0)
        except TimeoutError:
            pass
    print(file=sys.stderr)


def print_summary(summary: dict, slo_results: list[dict]) -> None:
    for key, value in summary.items():
        print(f"  {key:<30}{value}")
    for s in slo_results:
        print(f"  SLO {s['slo']:<26}{'PASS' if s['passed'] else 'FAIL'} (value {s['value']})")
