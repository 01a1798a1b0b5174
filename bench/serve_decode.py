"""Decode sweep of bench/serve.py: one row's step time, its memory roofline, and the fast path's kernel profile."""

from __future__ import annotations

import functools
import time

import torch

from bench.serve_rank import Rank, set_environ, sync
from k3core.model import K3Model
from kernels.perf import harness
from services.engine import fast_ffn


def step_bytes(model: K3Model, batch: int, context: int) -> int:
    """Bytes one decode step must move at minimum: weights touched, KDA state read+write, MLA latents."""
    c = model.config
    expert_bytes = experts = total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert_bytes, experts = expert_bytes + nbytes, experts + 1
        elif "embed_tokens" not in name:
            total += nbytes
    if experts:
        per_expert = expert_bytes / (experts / 3)  # w1, w2, w3 per expert
        moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        total += int(moe_layers * min(c.num_experts, batch * c.num_experts_per_token) * per_expert)
    heads, d, w = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
    state = len(c.kda_layers) * heads * (d * d * 4 + 3 * d * (w - 1) * 2)
    latent = len(c.mla_layers) * c.mla_latent_dim * 2 * context
    return total + batch * (2 * state + latent)


def decode_row(rank: Rank, batch: int, context: int, steps: int, tag: str,
               publish_feed: bool = False) -> tuple[float, float, float, dict, dict]:
    """(wall seconds per engine step, "fwd" seconds, graph replay seconds, the critical path's parts in us, the
    routing after the row (`row_routing`; {} without the fast path)) of `batch` requests at `context` tokens,
    through the engine's loop (`bench.serve_engine`): "fwd" runs from the moment a step's tokens are on the
    host (the device idles from there) to the end of the next step's forward; the parts:
    `StepClock.critical_path`. Without the service runtime's packages, the rank's own loop (`rank_decode`,
    said so in the output and the JSON; no parts). `publish_feed`: `engine_decode`'s."""
    rids = [f"{tag}-{batch}-{context}-{i}" for i in range(batch)]
    missing = engine_loop_missing()
    if missing:
        wall, forward = rank_decode(rank, rids, context, steps)
        replay, path = replay_seconds(rank, batch, steps), {}
    else:
        from bench.serve_engine import engine_decode
        from bench.step_clock import critical_path_line

        wall, clock = engine_decode(rank, rids, context, steps, publish_feed)
        forward, replay = clock.median_seconds(), replay_seconds(rank, batch, steps)
        path = clock.critical_path(replay)
        print(critical_path_line(path), flush=True)
    routing = row_routing(rank, rids, steps + 64) if rank.fast is not None else {}
    if routing:
        print(f"  routing after the row: {routing}", flush=True)
    rank.finish(rids)
    return wall, forward, replay, path, routing


@functools.cache
def engine_loop_missing() -> str:
    """"" when `bench.serve_engine` imports (grpcio, protobuf, prometheus-client: on the device from
    .device/wheels), else why not (printed once)."""
    try:
        import bench.serve_engine  # noqa: F401
    except ImportError as exc:
        print(f"decode rows: the engine loop is unavailable ({exc}); timing the rank's loop (Rank.decode: no "
              f"scheduler, overlap or streams) instead", flush=True)
        return str(exc)
    return ""


def rank_decode(rank: Rank, rids: list[str], context: int, steps: int) -> tuple[float, float]:
    """The fallback: (wall seconds per `Rank.decode` step, median forward seconds from before its input build
    to after the replay)."""
    batch = len(rids)
    rank.fill(rids, context)
    for step in range(3):  # captures this bucket's graph, then warm
        rank.decode(rids, rank.next_tokens(batch, step))
    sync()
    rank.forward_s.clear()
    started = time.perf_counter()
    for step in range(steps):
        rank.decode(rids, rank.next_tokens(batch, step))
    sync()
    return (time.perf_counter() - started) / steps, sorted(rank.forward_s)[len(rank.forward_s) // 2]


def replay_seconds(rank: Rank, batch: int, reps: int) -> float:
    """Device seconds of one graph replay alone, back to back (no host work in between: the forward's own
    cost, launch gaps included); NaN without CUDA graphs. It rewrites the rows' state pages (the cost is
    what matters here)."""
    graphs = rank.fast.graphs if rank.fast is not None else None
    if graphs is None:
        return float("nan")
    graph = graphs._get(graphs.bucket(batch)).graph
    ms, _ = harness.time_ms(graph.replay, inner=reps, reps=1, warmup=0, graph=False)  # events around `reps` replays
    return ms / 1e3


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """"name=ENV=value,ENV=value" (or "name=") -> (name, settings): a `--variant` of bench.serve."""
    name, _, rest = text.partition("=")
    settings = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, settings


def apply_variant(rank: Rank, settings: dict[str, str], base: dict[str, str | None]) -> None:
    """The process environment as it started (`base`: the values of every variant's names) plus `settings`,
    and the rank's CUDA graphs rebuilt (captured again on first use) since their form is read at build."""
    set_environ({key: settings.get(key, value) for key, value in base.items()})
    if rank.fast is not None:
        rank.fast.rebuild()


def routes_by_tokens(rank: Rank, batch: int) -> bool:
    """Whether a row's expert bytes follow its tokens: a grouped MoE form (not the dense one), or the routed
    form (the grouped form's rows from its own kernels: an expert no token picked is not read), at batch > 1."""
    fast = rank.fast
    moe = [ffn for ffn in fast.decoder.ffn if isinstance(ffn, fast_ffn.MoeDecode)] if fast is not None else []
    return batch > 1 and any(not ffn.dense(batch) or ffn.routed(batch) for ffn in moe)


def decode_sweep_row(rank: Rank, model: K3Model, batch: int, context: int, steps: int, bandwidth: float,
                     variant: str = "") -> dict:
    """One row of the sweep (printed as it is measured): step and forward time against the roofline. "step" is
    the timed window's wall time over its steps: it includes the window's two ends (the first launch from an
    idle device, the last step with nothing left to overlap: ~0.7 ms once, docs/serving.md item 14); "steady"
    is the mean device-clock cycle between consecutive forwards' ends inside it (`StepClock.critical_path`),
    the step a continuously decoding worker pays (NaN where the rank's own loop runs).
    With the draw in the graph the device reads the greedy argmax, one token for every row on random weights
    (and the bench's rows have no real history: their hidden states hardly differ), not the bench's feed:
    where the experts read follow the tokens (`routes_by_tokens`) the row would read fewer experts than the
    roofline counts, so there the feed is published over the argmax after each draw (and the row says so).
    Such a row whose routing check (`row_routing`) read under half the experts the roofline counts in a layer
    is labelled not comparable."""
    publish = rank.fast is not None and rank.fast.draw_in_graph and routes_by_tokens(rank, batch)
    if publish:
        variant = f"{variant} (feed published over the graph's argmax)".strip()
    wall, forward, replay, path, routing = decode_row(rank, batch, context, steps, "d", publish)
    counted = min(model.config.num_experts, batch * model.config.num_experts_per_token)
    if publish and routing and 2 * routing["experts_touched_min"] < counted:
        # rows routed alike (session 9: 4 experts a layer at 64 / 1024, NaN rows from latents `Rank.fill` left
        # stale, docs/serving.md item 20): a form that reads only the picked experts then moves far less than
        # the roofline counts (a few experts short is chance: 64 uniform top-4 picks of 32 leave ~0.006 unread)
        variant = f"{variant} (NOT comparable: routing collapsed, {routing['experts_touched_min']} of the " \
                  f"{counted} experts the roofline counts read in a layer)"
    roof = step_bytes(model, batch, context) / bandwidth
    steady = path.get("cycle_mean_us", float("nan")) / 1e6
    print(f"{batch:>6} {context:>8} {1e3 * wall:>9.2f} {1e3 * steady:>9.3f} {1e3 * forward:>8.2f} {batch / wall:>9.1f} "
          f"{1e3 * roof:>12.3f} {roof / wall:>8.1%} {roof / steady:>8.1%} {1e3 * replay:>10.2f} "
          f"{roof / replay:>10.1%} {variant}", flush=True)
    return {"batch": batch, "context": context, "step_s": wall, "forward_s": forward, "tokens_per_s": batch / wall,
            "roofline_step_s": roof, "fraction_of_roofline": roof / wall, "forward_fraction_of_roofline": roof / forward,
            "steady_step_s": steady, "steady_fraction_of_roofline": roof / steady,
            "replay_s": replay, "replay_fraction_of_roofline": roof / replay,
            "critical_path_us": path, "routing": routing, "variant": variant,
            "loop": f"rank ({engine_loop_missing()})" if engine_loop_missing() else "engine"}


SWEEP_HEADER = (f"{'batch':>6} {'context':>8} {'step ms':>9} {'steady ms':>9} {'fwd ms':>8} {'tok/s':>9} "
                f"{'roofline ms':>12} {'of roof':>8} {'steady/rf':>8} {'replay ms':>10} {'replay/roof':>10} variant")


def routed_step(rank: Rank, rids: list[str], tokens: list[int]) -> tuple[object, list[list[int]], int]:
    """One eager fast-path forward of the rows on `tokens` (the step begun, not ended): its inputs, per MoE
    layer the tokens each expert got (what the routed and grouped forms read follows them; the roofline counts
    min(experts, batch x top-k) experts a layer), and how many rows' logits are finite (a NaN row's router
    picks the same top-k as every other NaN row: docs/serving.md item 20)."""
    inputs = rank.step_inputs(rids, tokens)
    loads: list[list[int]] = []
    route = fast_ffn.MoeDecode._route

    def counting_route(self, x):
        weights, indices = route(self, x)
        loads.append(torch.bincount(indices.flatten(), minlength=self.w13.shape[0]).tolist())
        return weights, indices

    fast_ffn.MoeDecode._route = counting_route  # eager only: count the experts each MoE layer reads
    try:
        finite = int(rank.fast.decoder.forward(inputs).isfinite().all(-1).sum())
    finally:
        fast_ffn.MoeDecode._route = route
    return inputs, loads, finite


def row_routing(rank: Rank, rids: list[str], step: int) -> dict:
    """The routing of a row's rows after its timed steps, on one more feed (a check that the row read the
    experts the roofline counts: rows whose hidden states are alike, or NaN, all pick the same top-k)."""
    _, loads, finite = routed_step(rank, rids, rank.next_tokens(len(rids), step))
    rank.end_step(rids)
    return {"experts_touched_min": min((sum(1 for n in layer if n) for layer in loads), default=0),
            "experts": len(loads[0]) if loads else 0,
            "max_expert_load": max((max(layer) for layer in loads), default=0), "finite_rows": finite}


def profile_forward(rank: Rank, batch: int, context: int) -> dict:
    """Kernel time by name of one eager fast-path forward (printed, and returned for the JSON): where the
    step's device time goes."""
    from torch.profiler import ProfilerActivity, profile

    rids = [f"prof-{i}" for i in range(batch)]
    rank.fill(rids, context)
    inputs, loads, finite = routed_step(rank, rids, rank.next_tokens(batch, 0))
    fast = rank.fast
    touched, most = [sum(1 for n in layer if n) for layer in loads], [max(layer) for layer in loads]
    print(f"experts touched per MoE layer at batch {batch}: {touched}; most tokens on one expert: {most}; "
          f"rows with finite logits: {finite}")
    with profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]) as prof:
        fast.decoder.forward(inputs)
        sync()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events)
    kernels = sum(e.count for e in events)
    print(f"profile batch {batch} ctx {context}: {kernels} kernels, {total / 1e3:.2f} ms device")
    top = sorted(events, key=lambda e: -e.device_time_total)[:40]
    for e in top:
        print(f"  {e.device_time_total / 1e3:7.3f} ms {e.count:5d}x  {e.key[:90]}")
    rank.end_step(rids)
    rank.finish(rids)
    return {"batch": batch, "context": context, "kernels": kernels, "device_ms": total / 1e3, "experts_touched": touched,
            "max_expert_load": most, "finite_rows": finite,
            "top": [{"ms": e.device_time_total / 1e3, "count": e.count, "name": e.key[:120]} for e in top]}
