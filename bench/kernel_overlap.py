"""What ran beside each kernel of a profiled run (GPU spans of a chrome trace, `serve_trace_gaps.spans`), and how a
kernel's duration in one run (a captured graph's replays, side branches on) compares with another (the eager
forward, one stream). Concurrency is read off the timeline, not the stream ids: a graph replay's kernels may all
be reported on the stream the graph was launched into."""

from __future__ import annotations

import statistics
from collections import defaultdict

from bench.serve_trace_gaps import Span, overlap

SHORT = 60  # characters of a kernel's name kept in tables


def short(name: str) -> str:
    return name[:SHORT]


def beside(spans: list[Span]) -> list[list[tuple[Span, float]]]:
    """For each span (sorted by start), the other spans that overlap it in time, with the overlap in us."""
    out: list[list[tuple[Span, float]]] = [[] for _ in spans]
    for i, a in enumerate(spans):
        for j in range(i + 1, len(spans)):
            b = spans[j]
            if b.start >= a.end:
                break
            us = overlap(a, b.start, b.end)
            if us > 0:
                out[i].append((b, us))
                out[j].append((a, us))
    return out


def by_name(spans: list[Span], runs: int = 1) -> dict[str, dict]:
    """Per kernel name: launches per run, median and total us per run, and (with `beside`) the us per run other
    kernels overlapped it."""
    stats: dict[str, dict] = defaultdict(lambda: {"durations": [], "beside_us": 0.0})
    for span, others in zip(spans, beside(spans), strict=True):
        entry = stats[short(span.name)]
        entry["durations"].append(span.end - span.start)
        entry["beside_us"] += sum(us for _, us in others)
    return {name: {"count": len(e["durations"]) / runs, "median_us": statistics.median(e["durations"]),
                   "total_us": sum(e["durations"]) / runs, "beside_us": e["beside_us"] / runs}
            for name, e in stats.items()}


def compare(graph: dict[str, dict], eager: dict[str, dict]) -> list[dict]:
    """The kernel names of both tables, the largest (graph - eager) x launches first: what a captured run pays
    per run beyond the same kernels one at a time."""
    rows = []
    for name, g in graph.items():
        e = eager.get(name)
        if e is None:
            continue
        extra = (g["median_us"] - e["median_us"]) * g["count"]
        rows.append({"name": name, "count": g["count"], "eager_us": e["median_us"], "graph_us": g["median_us"],
                     "extra_us": extra, "beside_us": g["beside_us"]})
    return sorted(rows, key=lambda r: -r["extra_us"])


def neighbours(spans: list[Span], match: str, top: int = 6) -> list[dict]:
    """Each span whose name holds `match`: its duration, and the `top` spans overlapping it the longest (name,
    overlap us, start relative to its start: negative = already running when it began)."""
    rows = []
    for span, others in zip(spans, beside(spans), strict=True):
        if match not in span.name:
            continue
        others = sorted(others, key=lambda o: -o[1])[:top]
        rows.append({"start_us": span.start, "us": span.end - span.start,
                     "beside": [[short(o.name), round(us, 2), round(o.start - span.start, 2)] for o, us in others]})
    return rows


def table(rows: list[dict], top: int = 20) -> str:
    lines = [f"{'launches':>8} {'eager us':>9} {'graph us':>9} {'extra us':>9} {'beside us':>9}  kernel"]
    lines += [f"{r['count']:>8g} {r['eager_us']:>9.2f} {r['graph_us']:>9.2f} {r['extra_us']:>9.1f} "
              f"{r['beside_us']:>9.1f}  {r['name']}" for r in rows[:top]]
    return "\n".join(lines)
