"""A chrome trace of engine decode steps (`torch.profiler`, bench/serve_trace.py) split per step: the GPU's
idle intervals and the host ranges (the engine's `k3.*` labels, profiler CPU ops, CUDA runtime calls) that
overlap each, and how much of each step's wall time the labels cover."""

from __future__ import annotations

import gzip
import json
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.profiler import profile

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"user_annotation", "cpu_op", "cuda_runtime", "cuda_driver", "python_function"}
LABEL = "k3."
TIMELINE = 40  # host ranges kept per gap of TIMELINE_MIN_US or more, in order
TIMELINE_MIN_US = 20.0


@dataclass
class Span:
    name: str
    start: float  # us
    end: float
    tid: object = None


def export_trace(prof: profile, path: Path | None) -> dict:
    """The profiler's chrome trace as a dict, also written gzipped to `path` (None: not kept)."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    if path is not None:
        with gzip.open(path, "wt") as f:
            json.dump(trace, f)
    return trace


def spans(trace: dict) -> tuple[list[Span], list[Span], list[Span]]:
    """(steps `ProfilerStep#k`, host ranges, GPU ops) of a chrome trace, each sorted by start."""
    steps, host, gpu = [], [], []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        span = Span(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("tid"))
        if e.get("cat") in GPU_CATS:
            gpu.append(span)
        elif e.get("cat") in HOST_CATS:  # not "gpu_user_annotation": a range's projection on the GPU's timeline
            (steps if span.name.startswith("ProfilerStep#") else host).append(span)
    return [sorted(x, key=lambda s: s.start) for x in (steps, host, gpu)]


def gaps(gpu: list[Span], min_us: float) -> list[Span]:
    """The GPU's idle intervals longer than `min_us` between its ops (all streams merged), each named
    "<op before> -> <op after>"."""
    out: list[Span] = []
    end, last = None, ""
    for op in gpu:
        if end is not None and op.start - end > min_us:
            out.append(Span(f"{last[:48]} -> {op.name[:48]}", end, op.start))
        if end is None or op.end >= end:
            end, last = op.end, op.name
    return out


def overlap(a: Span, start: float, end: float) -> float:
    return max(0.0, min(a.end, end) - max(a.start, start))


def union_length(ranges: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(ranges):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def host_overlaps(host: list[Span], start: float, end: float) -> dict[str, float]:
    """us of each host range name inside [start, end] (nested ranges each count in full)."""
    out: dict[str, float] = defaultdict(float)
    for span in host:
        if span.start >= end:
            break
        us = overlap(span, start, end)
        if us > 0:
            out[span.name] += us
    return dict(out)


def breakdown(trace: dict, min_gap_us: float = 5.0) -> dict:
    """Per step: wall, the labels' time and their coverage of the step (on the step's thread), GPU busy time,
    and each GPU gap with the host ranges overlapping it; then the gaps summed over steps by kind."""
    steps, host, gpu = spans(trace)
    idle = gaps(gpu, min_gap_us)
    rows, by_kind = [], defaultdict(lambda: {"count": 0, "us": 0.0, "host": defaultdict(float)})
    for step in steps:
        wall = step.end - step.start
        mine = [s for s in host if s.tid == step.tid and s.name.startswith(LABEL) and overlap(s, step.start, step.end)]
        labels: dict[str, float] = defaultdict(float)
        for s in mine:
            labels[s.name] += overlap(s, step.start, step.end)
        covered = union_length([(max(s.start, step.start), min(s.end, step.end)) for s in mine])
        busy = union_length([(max(g.start, step.start), min(g.end, step.end)) for g in gpu
                             if overlap(g, step.start, step.end)])
        row_gaps, own = [], [g for g in idle if step.start <= g.start < step.end]
        reach = max([step.end] + [g.end for g in own])  # a gap may end in the next step
        host_here = [s for s in host if overlap(s, step.start, reach)]  # (keeps the scans below short)
        for gap in own:
            over = host_overlaps(host_here, gap.start, gap.end)
            unlabelled = gap.end - gap.start - union_length(
                [(max(s.start, gap.start), min(s.end, gap.end)) for s in host_here
                 if s.name.startswith(LABEL) and overlap(s, gap.start, gap.end)])
            # in order, from the gap's start (negative: began before it), the first TIMELINE of them
            timeline = [[s.name, s.start - gap.start, s.end - s.start] for s in host_here
                        if overlap(s, gap.start, gap.end)][:TIMELINE] if gap.end - gap.start >= TIMELINE_MIN_US else []
            row_gaps.append({"between": gap.name, "at_us": gap.start - step.start, "us": gap.end - gap.start,
                             "host_us": over, "unlabelled_us": unlabelled, "timeline": timeline})
            kind = by_kind[gap.name]
            kind["count"] += 1
            kind["us"] += gap.end - gap.start
            for name, us in over.items():
                kind["host"][name] += us
        rows.append({"step": step.name, "wall_us": wall, "labels_us": dict(labels), "label_coverage": covered / wall,
                     "unlabelled_us": wall - covered, "gpu_busy_us": busy, "gaps": row_gaps})
    kinds = sorted(({"between": k, "count": v["count"], "us": v["us"],
                     "host_us": dict(sorted(v["host"].items(), key=lambda kv: -kv[1]))} for k, v in by_kind.items()),
                   key=lambda k: -k["us"])
    return {"steps": rows, "gaps_by_kind": kinds, "min_gap_us": min_gap_us}


def report(summary: dict, kinds: int = 6, top: int = 8, timeline: int = 20) -> str:
    """The breakdown as text: one line per step, the medians, then the longest `kinds` kinds of gap with the
    `top` host ranges overlapping each; first the longest gap's first `timeline` host ranges, in order."""
    lines = [f"{'step':>16} {'wall us':>9} {'labels':>7} {'unlabelled':>10} {'gpu busy':>9} {'gaps':>5} {'idle us':>8}"
             f"  labels (us)"]
    for row in summary["steps"]:
        idle = sum(g["us"] for g in row["gaps"])
        named = " ".join(f"{k[3:]}={v:.0f}" for k, v in sorted(row["labels_us"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{row['step']:>16} {row['wall_us']:>9.0f} {row['label_coverage']:>7.1%} {row['unlabelled_us']:>10.0f} "
                     f"{row['gpu_busy_us']:>9.0f} {len(row['gaps']):>5} {idle:>8.0f}  {named}")
    steps = max(1, len(summary["steps"]))
    if summary["steps"]:
        def median(key) -> float:
            return statistics.median(key(row) for row in summary["steps"])
        lines.append(f"median of {len(summary['steps'])} steps: wall {median(lambda r: r['wall_us']):.0f} us, GPU busy "
                     f"{median(lambda r: r['gpu_busy_us']):.0f}, GPU idle {median(lambda r: sum(g['us'] for g in r['gaps'])):.0f}"
                     f" in gaps > {summary['min_gap_us']:g} us, unlabelled host {median(lambda r: r['unlabelled_us']):.0f}")
        longest = max((g for r in summary["steps"] for g in r["gaps"]), key=lambda g: g["us"], default=None)
        if longest is not None:  # where the time goes, in order
            lines.append(f"longest gap ({longest['us']:.1f} us, {longest['between']}), host ranges from its start (us):")
            lines += [f"    {at:8.1f} {us:8.1f}  {name[:90]}" for name, at, us in longest["timeline"][:timeline]]
    for kind in summary["gaps_by_kind"][:kinds]:
        lines.append(f"gap {kind['between']}: {kind['count']}x, {kind['us'] / steps:.1f} us per step; host ranges "
                     f"overlapping it (us per step):")
        for name, us in list(kind["host_us"].items())[:top]:
            lines.append(f"    {us / steps:9.1f}  {name[:90]}")
    return "\n".join(lines)
