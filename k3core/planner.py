"""Memory planner (`k3 plan`): weights per rank, cache per sequence and per token, and what fits.

The hybrid cache costs a fixed KDA state per sequence plus MLA latents per token; an all-MLA model of the
same depth costs only per-token latents. Below the crossover context the hybrid cache is the larger one
(close reading of the K3 report: ~3,072 tokens for K3 with a 512-value latent and bf16 state).
Tensor parallelism splits KDA heads (and attention/MLP weights); the MLA latent is shared by all heads, so
every rank holds all of it. Routed experts are split over `ep` ranks (default: the TP degree).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from k3core.config import ConfigError, K3Config
from k3core.model.parameters import parameter_shapes
from k3core.presets import PRESET_NAMES, preset
from k3core.weights import shard_rules

MIB, GIB = 2**20, 2**30
DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "mxfp4": 0.53125}  # mxfp4: 4 bits + e8m0/32


@dataclass(frozen=True)
class CachePlan:
    kda_state_bytes: int  # one sequence, every KDA layer, this rank (recurrent + short-conv tails)
    mla_token_bytes: int  # one token, every MLA layer
    all_mla_token_bytes: int  # one token if every layer were MLA (the comparison model)

    def sequence_bytes(self, context: int) -> int:
        return self.kda_state_bytes + context * self.mla_token_bytes

    @property
    def crossover_vs_all_mla(self) -> float:
        """Context above which the hybrid cache is smaller than the all-MLA cache."""
        return self.kda_state_bytes / (self.all_mla_token_bytes - self.mla_token_bytes)

    @property
    def state_equals_kv_at(self) -> float:
        """Context at which the MLA latents weigh as much as the KDA state."""
        return self.kda_state_bytes / self.mla_token_bytes


def cache_plan(
    config: K3Config,
    tp: int = 1,
    state_dtype: str = "bf16",
    mla_dtype: str = "bf16",
    latent_values: int | None = None,
    include_conv: bool = True,
) -> CachePlan:
    """`latent_values` defaults to what the cache stores (kv_lora_rank + qk_rope_head_dim)."""
    if config.kda_num_heads % tp:
        raise ConfigError(f"tp={tp} does not divide the {config.kda_num_heads} KDA heads")
    heads, dim = config.kda_num_heads // tp, config.kda_head_dim
    per_layer = heads * dim * dim * DTYPE_BYTES[state_dtype]
    if include_conv:
        per_layer += 3 * heads * dim * (config.short_conv_kernel_size - 1) * DTYPE_BYTES[mla_dtype]
    latent = (latent_values or config.mla_latent_dim) * DTYPE_BYTES[mla_dtype]
    return CachePlan(
        kda_state_bytes=int(per_layer * len(config.kda_layers)),
        mla_token_bytes=int(latent * len(config.mla_layers)),
        all_mla_token_bytes=int(latent * config.num_hidden_layers),
    )


def weight_bytes_per_rank(
    config: K3Config,
    tp: int = 1,
    ep: int | None = None,
    dense_dtype: str = "bf16",
    expert_dtype: str = "mxfp4",
) -> int:
    """Routed experts in `expert_dtype` split over `ep` ranks; what the workers' sharding rules replicate
    (norms, router, low-rank down projections, latent-MoE projections) whole; the rest split over `tp`
    ranks, in `dense_dtype`."""
    ep = ep or tp
    total = 0.0
    for name, shape in parameter_shapes(config).items():
        count = math.prod(shape)
        kind = shard_rules.rule_for(name)
        if kind == shard_rules.EXPERT:
            total += count * DTYPE_BYTES[expert_dtype] / ep  # expert e lives on one of the ep ranks
        elif kind == shard_rules.REPLICATE:
            total += count * DTYPE_BYTES[dense_dtype]
        else:
            total += count * DTYPE_BYTES[dense_dtype] / tp
    return math.ceil(total)


def sequences_that_fit(free_bytes: float, plan: CachePlan, context: int) -> int:
    return max(0, int(free_bytes // plan.sequence_bytes(context)))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3 plan", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", default="k3", choices=PRESET_NAMES)
    source.add_argument("--config", help="a config.json instead of a preset")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (splits KDA heads)")
    parser.add_argument("--ep", type=int, help="expert-parallel degree (default: --tp)")
    parser.add_argument("--gpu-mem-gib", type=float, default=141.0, help="memory per GPU (H200: 141)")
    parser.add_argument(
        "--reserve-gib", type=float, default=8.0, help="activations, workspace, fragmentation"
    )
    parser.add_argument("--context", type=int, default=131072, help="tokens per sequence for the fit count")
    parser.add_argument("--state-dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--mla-dtype", default="bf16", choices=("bf16", "fp8"))
    parser.add_argument("--expert-dtype", default="mxfp4", choices=("mxfp4", "bf16", "fp8"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    for name in ("tp", "context"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def plan(args: argparse.Namespace) -> dict:
    config = K3Config.from_json_file(args.config) if args.config else preset(args.preset)
    cache = cache_plan(config, args.tp, args.state_dtype, args.mla_dtype)
    paper = cache_plan(config, 1, "bf16", "bf16", latent_values=config.kv_lora_rank, include_conv=False)
    weights = weight_bytes_per_rank(config, args.tp, args.ep, "bf16", args.expert_dtype)
    free = args.gpu_mem_gib * GIB - weights - args.reserve_gib * GIB
    return {
        "model": args.config or args.preset,
        "tp": args.tp,
        "ep": args.ep or args.tp,
        "weight_bytes_per_rank": weights,
        "kda_state_bytes_per_sequence": cache.kda_state_bytes,
        "mla_bytes_per_token": cache.mla_token_bytes,
        "crossover_vs_all_mla_tokens": round(cache.crossover_vs_all_mla),
        "state_equals_kv_tokens": round(cache.state_equals_kv_at),
        "close_reading_count": {k: v for k, v in asdict(paper).items() if k != "all_mla_token_bytes"}
        | {"crossover_vs_all_mla_tokens": round(paper.crossover_vs_all_mla),
           "state_equals_kv_tokens": round(paper.state_equals_kv_at)},
        "context": args.context,
        "free_bytes_per_rank": int(free),
        "sequences_that_fit": sequences_that_fit(free, cache, args.context),
    }  # fmt: skip


def _table(p: dict) -> str:
    c = p["close_reading_count"]
    rows = [
        ("model / tp / ep", f"{p['model']} / {p['tp']} / {p['ep']}"),
        ("weights per rank", f"{p['weight_bytes_per_rank'] / GIB:,.2f} GiB"),
        ("KDA state per sequence", f"{p['kda_state_bytes_per_sequence'] / MIB:,.1f} MiB (recurrent + conv tails)"),
        ("MLA latent per token", f"{p['mla_bytes_per_token'] / 1024:,.2f} KiB (c_kv + k_pe, all MLA layers)"),
        ("hybrid < all-MLA above", f"{p['crossover_vs_all_mla_tokens']:,} tokens"),
        ("MLA KV = KDA state at", f"{p['state_equals_kv_tokens']:,} tokens"),
        ("whole model, as counted", f"state {c['kda_state_bytes'] / MIB:,.0f} MiB, {c['mla_token_bytes'] / 1024:,.0f} "
                                  f"KiB/token, crossovers {c['crossover_vs_all_mla_tokens']:,} / "
                                  f"{c['state_equals_kv_tokens']:,} tokens (seeds/003: 512-value latent, no conv)"),
        ("free per rank", f"{p['free_bytes_per_rank'] / GIB:,.2f} GiB"),
        (f"sequences of {p['context']:,} tokens", f"{p['sequences_that_fit']:,}"
                                                   + ("" if p["free_bytes_per_rank"] > 0 else " (weights do not fit)")),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        result = plan(args)
    except (ConfigError, OSError) as exc:
        print(f"k3 plan: {exc}")
        return 2
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
