"""The drill report: a summary (the numbers SLOs are checked against), JSON, and an HTML page with
TTFT and errors over time and the re-prefill load each surviving cluster took."""

from __future__ import annotations

import dataclasses
import html
import json
from collections import Counter
from pathlib import Path

from services.cli.drill.load import RequestRecord

SUMMARY_METRICS = {"requests", "errors", "errors_before_first_token", "errors_mid_stream", "client_retries",
                   "lost_sessions", "ttft_p50_ms", "ttft_p99_ms", "ttft_p99_before_ms", "ttft_p99_after_ms",
                   "detect_s", "moved_sessions", "moved_off_backup", "reprefill_ratio", "reprefill_max_share",
                   "healthy_clusters_min"}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 1)


def moved_sessions(records: list[RequestRecord], fault_at: float, fault_cluster: str,
                   primaries: dict[str, str]) -> dict[str, RequestRecord]:
    """Sessions whose primary is the faulty cluster and that were served elsewhere after the fault, each
    with the request that landed on the new cluster (it re-prefilled the session's history there)."""
    moved: dict[str, RequestRecord] = {}
    for r in sorted(records, key=lambda r: r.end or 0.0):
        if (r.ok and r.end is not None and r.end >= fault_at and r.session not in moved
                and primaries.get(r.session) == fault_cluster and any(c != fault_cluster for c in r.clusters)):
            moved[r.session] = r
    return moved


def landing(record: RequestRecord, fault_cluster: str) -> str:
    return next(c for c in record.clusters if c != fault_cluster)


def summarize(records: list[RequestRecord], fault_at: float, fault_cluster: str, clusters: list[str],
              detect_at: float | None, sessions: int,
              placements: dict[str, tuple[str, str]] | None = None) -> dict:
    """The drill's numbers. `placements` (session -> (primary, backup), asked of the router before the
    fault) says which sessions the fault should move and where; without it a session's primary is where
    it was first served."""
    # A request that failed, was retried by the client and then succeeded is not an error (but a retry).
    final = {}
    for r in records:
        final[(r.session, r.turn)] = r
    errors = [r for r in final.values() if not r.ok]
    ttft = [r.ttft for r in final.values() if r.ok and r.ttft is not None]
    before = [r.ttft for r in final.values() if r.ok and r.ttft is not None and r.start < fault_at]
    after = [r.ttft for r in final.values() if r.ok and r.ttft is not None and r.start >= fault_at]

    placements = placements or {}
    primaries = {s: p for s, (p, _) in placements.items()}
    for r in sorted(records, key=lambda r: r.start):
        if r.ok and r.clusters:
            primaries.setdefault(r.session, r.clusters[0])
    moved = moved_sessions(records, fault_at, fault_cluster, primaries)
    survivors = [c for c in clusters if c != fault_cluster]
    per_cluster = Counter(landing(r, fault_cluster) for r in moved.values())
    tokens = Counter()
    for r in moved.values():
        tokens[landing(r, fault_cluster)] += r.prompt_tokens
    off_backup = sum(1 for s, r in moved.items() if s in placements and landing(r, fault_cluster) != placements[s][1])
    total_moved = len(moved)
    max_share = max(per_cluster.values()) / total_moved if total_moved else None
    ideal = 1 / len(survivors) if survivors else None
    return {
        "requests": len(final),
        "errors": len(errors),
        "errors_before_first_token": sum(1 for r in errors if r.ttft is None),
        "errors_mid_stream": sum(1 for r in errors if r.ttft is not None),
        "client_retries": sum(1 for r in records if r.attempt > 0),
        "lost_sessions": len({r.session for r in errors}) + sessions - len({r.session for r in final.values()}),
        "ttft_p50_ms": _ms(percentile(ttft, 0.5)),
        "ttft_p99_ms": _ms(percentile(ttft, 0.99)),
        "ttft_p99_before_ms": _ms(percentile(before, 0.99)),
        "ttft_p99_after_ms": _ms(percentile(after, 0.99)),
        "detect_s": None if detect_at is None else round(detect_at - fault_at, 3),
        "moved_sessions": total_moved,
        "moved_off_backup": off_backup,
        "reprefill_per_cluster": {c: per_cluster.get(c, 0) for c in survivors},
        "reprefill_tokens_per_cluster": {c: tokens.get(c, 0) for c in survivors},
        "reprefill_max_share": None if max_share is None else round(max_share, 4),
        "reprefill_ideal_share": None if ideal is None else round(ideal, 4),
        "reprefill_ratio": None if max_share is None or not ideal else round(max_share / ideal, 3),
        "error_samples": sorted({r.error for r in errors})[:5],
    }


def write(report_dir: Path, meta: dict, summary: dict, slo_results: list[dict], records: list[RequestRecord],
          placements: dict[str, tuple[str, str]] | None = None) -> Path:
    report_dir.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "summary": summary, "slos": slo_results,
            "placements": {s: {"primary": p, "backup": b} for s, (p, b) in (placements or {}).items()},
            "requests": [dataclasses.asdict(r) for r in records]}
    (report_dir / "report.json").write_text(json.dumps(data, indent=1))
    page = report_dir / "report.html"
    page.write_text(render_html(meta, summary, slo_results, records))
    return page


def _scatter(records: list[RequestRecord], fault_at: float, width: int = 760, height: int = 260) -> str:
    points = [(r.start, r.ttft if r.ok and r.ttft is not None else None, r) for r in records]
    t_max = max([p[0] for p in points] + [fault_at, 1e-3])
    y_max = max([p[1] for p in points if p[1] is not None] + [1e-3])
    palette = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
    names = sorted({r.clusters[-1] for r in records if r.clusters})
    color = {c: palette[i % len(palette)] for i, c in enumerate(names)}
    dots = []
    for t, y, r in points:
        x = 40 + (width - 60) * t / t_max
        if y is None:
            dots.append(f'<text x="{x:.1f}" y="{height - 22}" fill="#d62728" font-size="12">x</text>')
        else:
            c = color.get(r.clusters[-1] if r.clusters else "", "#333")
            dots.append(f'<circle cx="{x:.1f}" cy="{height - 30 - (height - 50) * y / y_max:.1f}" r="2" fill="{c}"/>')
    fx = 40 + (width - 60) * fault_at / t_max
    legend = " ".join(f'<tspan fill="{color[c]}">&#9679; {html.escape(c)}</tspan>' for c in names)
    return (f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
            f'<line x1="40" y1="{height - 30}" x2="{width - 20}" y2="{height - 30}" stroke="#999"/>'
            f'<line x1="40" y1="10" x2="40" y2="{height - 30}" stroke="#999"/>'
            f'<line x1="{fx:.1f}" y1="10" x2="{fx:.1f}" y2="{height - 30}" stroke="#d62728" stroke-dasharray="4"/>'
            f'<text x="{fx + 4:.1f}" y="22" fill="#d62728" font-size="12">fault</text>'
            f'<text x="44" y="20" font-size="12">TTFT (max {1000 * y_max:.0f} ms)</text>'
            f'<text x="{width - 140}" y="{height - 8}" font-size="12">time ({t_max:.1f} s)</text>'
            f'<text x="44" y="{height - 8}" font-size="12">{legend} <tspan fill="#d62728">x error</tspan></text>'
            + "".join(dots) + "</svg>")


def _bars(per_cluster: dict[str, int], ideal_share: float | None, width: int = 420, height: int = 200) -> str:
    if not per_cluster:
        return "<p>No sessions moved.</p>"
    total = sum(per_cluster.values()) or 1
    top = max(max(per_cluster.values()) / total, ideal_share or 0) or 1
    bar_w = (width - 60) / len(per_cluster)
    parts = []
    for i, (name, count) in enumerate(sorted(per_cluster.items())):
        h = (height - 50) * (count / total) / top
        x = 40 + i * bar_w
        parts.append(f'<rect x="{x + 4:.1f}" y="{height - 30 - h:.1f}" width="{bar_w - 8:.1f}" height="{h:.1f}" '
                     f'fill="#1f77b4"/><text x="{x + 6:.1f}" y="{height - 14}" font-size="12">'
                     f'{html.escape(name)} ({count})</text>')
    if ideal_share:
        y = height - 30 - (height - 50) * ideal_share / top
        parts.append(f'<line x1="40" y1="{y:.1f}" x2="{width - 20}" y2="{y:.1f}" stroke="#2ca02c" '
                     f'stroke-dasharray="4"/><text x="{width - 90}" y="{y - 4:.1f}" fill="#2ca02c" '
                     f'font-size="12">ideal</text>')
    return f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'


def render_html(meta: dict, summary: dict, slo_results: list[dict], records: list[RequestRecord]) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                   for k, v in summary.items())
    slos = "".join(f"<tr><td>{html.escape(s['slo'])}</td><td>{s['value']}</td>"
                   f"<td style='color:{'green' if s['passed'] else 'red'}'>{'PASS' if s['passed'] else 'FAIL'}</td></tr>"
                   for s in slo_results)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>K3 drill: {html.escape(meta['fault'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}td{{padding:2px 10px;border-bottom:1px solid #eee}}</style></head><body>
<h1>Drill: {html.escape(meta['fault'])} on {html.escape(meta['cluster'])}</h1>
<p>{html.escape(meta['injected'])} at t={meta['fault_at_s']:.2f}s; {meta['sessions']} sessions x {meta['turns']} turns,
concurrency {meta['concurrency']}.</p>
<h2>SLOs</h2><table>{slos}</table>
<h2>TTFT and errors over time</h2>{_scatter(records, meta['fault_at_s'])}
<h2>Re-prefill load per surviving cluster</h2>{_bars(summary['reprefill_per_cluster'], summary['reprefill_ideal_share'])}
<h2>Summary</h2><table>{rows}</table></body></html>"""
