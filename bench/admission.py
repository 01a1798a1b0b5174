"""Admission under a burst of 1M-token requests: per-class budgets vs one FIFO budget vs no admission.

    python bench/admission.py [--seconds 600] [--short-rate 100] [--burst 12] [--surge 150]

A discrete-event simulation of one cluster of prefill nodes driven by the calibrated cost model and the
service's own AdmissionScheduler. Steady short traffic (Poisson; 512-4096-token prompts, up to half of
each cached, 64-512 output tokens) runs alone, then again with a burst of 1M-token requests. A request's
time to first token is admission wait + wait for a node + its prefill; its ticket gives back its prefill
cost at the first token and the rest at its last token (decode runs at a fixed time per output token on
the separate decode pool).
A second scenario replaces the burst with a failover surge: the re-prefills (8K-32K-token sessions, none
of them cached on this backup cluster) that this survivor receives when another cluster dies.
Schemes: "class budgets" (independent SHORT/MEDIUM/LONG/FAILOVER/ROLLOUT budgets), "no failover share"
(the same, but re-prefills are classed by cost like any request), "FIFO budget" (one FIFO queue over one
budget of the same total), "no admission" (everything goes straight to the nodes).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.admission.classifier import RequestClassifier
from services.admission.config import DEFAULT_BUDGETS
from services.admission.cost_model import CostModel
from services.admission.scheduler import AdmissionScheduler, Rejection, Ticket

RESULTS = Path(__file__).resolve().parent / "results" / "admission.json"
NODES, GPUS_PER_NODE = 16, 8
DECODE_MS_PER_TOKEN = 30.0
QUEUE_DEADLINE_S = 3600.0
LONG_PROMPT, LONG_OUTPUT = 1_000_000, 1_024
# The service's default per-cluster budgets (GPU-ms in flight): SHORT ~4x its need, LONG two 1M requests.
CLASS_BUDGETS = DEFAULT_BUDGETS


@dataclass
class Request:
    arrival: float
    prompt: int
    cached: int
    output: int
    kind: str  # "short", "long" (the 1M burst) or "failover" (a re-prefill)
    request_class: str = ""
    cost: int = 0
    prefill_cost: int = 0
    ttft: float | None = None


def workload(seconds: float, rate: float, burst: int, surge: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        prompt = rng.randint(512, 4096)
        requests.append(Request(t, prompt, int(prompt * rng.uniform(0, 0.5)), rng.randint(64, 512), "short"))
    for _ in range(burst):
        requests.append(Request(rng.uniform(60, 70), LONG_PROMPT, 0, LONG_OUTPUT, "long"))
    for _ in range(surge):
        requests.append(Request(rng.uniform(60, 65), rng.randint(8_192, 32_768), 0, 256, "failover"))
    return sorted(requests, key=lambda r: r.arrival)


def simulate(requests: list[Request], scheme: str, model: CostModel, failover_budget: int) -> None:
    """Fills in each request's ttft (seconds)."""
    classifier = RequestClassifier(model)
    per_class = scheme.startswith(("class budgets", "no failover share"))
    class_budgets = dict(CLASS_BUDGETS, FAILOVER=failover_budget)
    budgets = class_budgets if per_class else {"SHORT": sum(class_budgets.values())}
    scheduler = AdmissionScheduler(budgets, max_queue=1 << 30)
    node_free_at = [0.0] * NODES
    events: list[tuple[float, int, str, object]] = []
    seq = itertools.count()
    waiting: dict[int, Request] = {}

    def dispatch(req: Request, now: float, ticket: Ticket | None) -> None:
        node = min(range(NODES), key=node_free_at.__getitem__)
        finish = max(now, node_free_at[node]) + model.prefill(req.prompt, req.cached) / GPUS_PER_NODE / 1e3
        node_free_at[node] = finish
        req.ttft = finish - req.arrival
        if ticket is not None:
            done = finish + req.output * DECODE_MS_PER_TOKEN / 1e3
            heapq.heappush(events, (finish, next(seq), "first_token", ticket.ticket_id))
            heapq.heappush(events, (done, next(seq), "release", ticket.ticket_id))

    for req in requests:
        c = classifier.classify(req.prompt, req.cached, req.output,
                                failover=req.kind == "failover" and scheme.startswith("class budgets"))
        req.request_class = c.request_class if per_class else "SHORT"
        req.cost, req.prefill_cost = c.cost, c.prefill_cost
        heapq.heappush(events, (req.arrival, next(seq), "arrive", req))
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(payload, Request)
            if scheme == "no admission":
                dispatch(payload, now, None)
                continue
            outcome = scheduler.offer(payload.request_class, payload.cost, now, now + QUEUE_DEADLINE_S,
                                      payload.prefill_cost)
            if isinstance(outcome, Rejection):
                raise RuntimeError(f"{scheme}: unexpected rejection: {outcome.reason}")
            if isinstance(outcome, Ticket):
                dispatch(payload, now, outcome)
            else:
                waiting[outcome.key] = payload
        else:
            released = scheduler.release(str(payload), now, prefill_only=kind == "first_token")
            for waiter, ticket in released.admitted:
                dispatch(waiting.pop(waiter.key), now, ticket)


def short_ttft(requests: list[Request]) -> np.ndarray:
    return np.array([r.ttft for r in requests if r.kind == "short"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--short-rate", type=float, default=100.0, help="short requests per second")
    parser.add_argument("--burst", type=int, default=12, help="1M-token requests arriving in [60 s, 70 s]")
    parser.add_argument("--surge", type=int, default=150, help="failover re-prefills arriving in [60 s, 65 s]")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    model = CostModel.k3_h200()
    default = CLASS_BUDGETS["FAILOVER"]
    # (scheme, FAILOVER budget): the default, then a sweep showing the failover share's trade-off.
    sweep = [(f"class budgets, FAILOVER={b // 1000}K", b) for b in (2 * default, 4 * default, 20 * default)]
    scenarios = {"1M burst": ((args.burst, 0), [(s, default) for s in ("class budgets", "FIFO budget",
                                                                      "no admission")]),
                 "failover surge": ((0, args.surge), [(s, default) for s in ("class budgets", "no failover share",
                                                                            "FIFO budget", "no admission")]
                                    + sweep)}
    rows = []
    header = (f"{'scenario':<15} {'scheme':<30} {'p50 base':>9} {'p99 base':>9} {'p50 event':>10} "
              f"{'p99 event':>10} {'p99 ratio':>10} {'event TTFT p50':>15}")
    print(f"{NODES} prefill nodes x {GPUS_PER_NODE} H200 (cost model), {args.short_rate:g} short req/s for "
          f"{args.seconds:g} s; event = {args.burst} x 1M-token requests, or {args.surge} failover "
          f"re-prefills; TTFT of the short requests in seconds")
    print(header + "\n" + "-" * len(header))
    for scenario, ((burst, surge), schemes) in scenarios.items():
        for scheme, failover_budget in schemes:
            base = workload(args.seconds, args.short_rate, 0, 0, args.seed)
            event = workload(args.seconds, args.short_rate, burst, surge, args.seed)
            simulate(base, scheme, model, failover_budget)
            simulate(event, scheme, model, failover_budget)
            b, e = short_ttft(base), short_ttft(event)
            others = [r.ttft for r in event if r.kind != "short"]
            row = {"scenario": scenario, "scheme": scheme, "failover_budget": failover_budget,
                   "short_p50_base_s": float(np.percentile(b, 50)),
                   "short_p99_base_s": float(np.percentile(b, 99)),
                   "short_p50_event_s": float(np.percentile(e, 50)),
                   "short_p99_event_s": float(np.percentile(e, 99)), "event_ttft_p50_s": float(np.median(others))}
            row["p99_ratio"] = row["short_p99_event_s"] / row["short_p99_base_s"]
            rows.append(row)
            print(f"{scenario:<15} {scheme:<30} {row['short_p50_base_s']:>9.3f} {row['short_p99_base_s']:>9.3f} "
                  f"{row['short_p50_event_s']:>10.3f} {row['short_p99_event_s']:>10.3f} "
                  f"{row['p99_ratio']:>9.2f}x {row['event_ttft_p50_s']:>15.1f}")
    print("bar (1M burst): class budgets p99 ratio <= 1.25x; FIFO budget p99 ratio >= 10x\n"
          "event TTFT p50: the 1M requests' or the re-prefills' own median TTFT (what their budget costs them)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"bench": "admission", "args": vars(args), "nodes": NODES,
                                   "gpus_per_node": GPUS_PER_NODE, "class_budgets": CLASS_BUDGETS,
                                   "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
