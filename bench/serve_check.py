"""bench/serve.py --check: one decode step through the fast path against the reference layers."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from bench.serve_rank import Rank
from services.engine.decode_fastpath import DecodeFastPath


def check_fast_path(rank: Rank, batch: int = 4, prompt_len: int = 96) -> dict:
    """One decode step through the fast path and through the reference layers from the same pool bytes
    (really prefilled prompts): logits and written KDA pages apart by how much. Variants localise a gap,
    each differing from `eager` in one thing: the graph as served, eager, eager with dense MoE, and eager
    with the kernels' references (K3_KERNELS_REFERENCE=1)."""
    manager, store = rank.manager, rank.manager.store
    rids = [f"check-{i}" for i in range(batch)]
    for i, rid in enumerate(rids):
        rank.prefill(rid, [(17 * i + 5 * j) % rank.vocab + 1 for j in range(prompt_len + 7 * i)])
    tokens = rank.next_tokens(batch, 0)
    rank.begin_step(rids, tokens)
    manager.pre_forward()
    cached = [manager.requests[r] for r in rids]
    state_pages = sorted(p for r in cached for p in r.state_pages)
    pages = sorted(set(state_pages) | {p for r in cached for b in r.blocks for p in b.pages})
    before = store.data[pages].clone()

    def run(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        store.data[pages] = before
        logits = forward().float().clone()
        return logits, store.data[state_pages].view(torch.float32).clone()

    def eager_path() -> DecodeFastPath:
        return DecodeFastPath(rank.runner.model, manager, max_model_len=rank.runner.max_model_len, graphs=False)

    eager, dense_path = eager_path(), eager_path()
    for op in dense_path.decoder.ffn:
        op.grouped = False

    def references() -> torch.Tensor:
        os.environ["K3_KERNELS_REFERENCE"] = "1"
        try:
            return eager.forward(cached, tokens)
        finally:
            del os.environ["K3_KERNELS_REFERENCE"]

    variants = {"graph": lambda: rank.fast.forward(cached, tokens), "eager": lambda: eager.forward(cached, tokens),
                "dense_moe": lambda: dense_path.forward(cached, tokens), "kernel_references": references}
    result = {"batch": batch}
    biases = [layer.block_sparse_moe.gate.e_score_correction_bias for layer in rank.runner.model.model.layers
              if layer.is_moe]
    # Random weights route on near ties, which bf16 rounding flips (whole experts apart, saying nothing about
    # either path); a large selection bias on four experts makes the routing decisive: then the fast path's
    # kernels must agree with the reference to bf16 rounding.
    for routing, lift in (("", 0.0), ("decisive routing, ", 10.0)):
        for bias in biases:
            bias.data[:4] += lift
        outs = {name: run(fn) for name, fn in variants.items()}
        ref_logits, ref_states = run(lambda: rank.runner.forward([[t] for t in tokens], manager.batch_view(rids)))
        for bias in biases:
            bias.data[:4] -= lift
        result[f"{routing}logits_std"] = float(ref_logits.std())
        for name, (logits, states) in outs.items():
            key = f"{routing}{name}"
            result[key] = {"logits_max_abs_diff": float((logits - ref_logits).abs().max()),
                           "argmax_equal": f"{int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())}/{batch}",
                           "state_page_max_abs_diff": float((states - ref_states).abs().max())}
            print(f"fast path ({key}) vs reference, one step at batch {batch}: {result[key]}")
    rank.end_step(rids)
    rank.finish(rids)
    return result
