"""bench.serve_glue's cases for the decode forward's dense-expert GEMMs (gate|up + GLU, down projection), the
routed experts' GEMMs (each expert over its routed rows only) and the paged MLA decode, per tiling, against what the fast path ran before them; and the helpers every case shares
(weight copies cycled so each timed call reads its weight from HBM)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3core.config import K3Config
from kernels.fused import expert_gemm_triton, naive, routed_expert_gemm_triton
from kernels.mla import decode_triton
from kernels.moe import situ_glu_triton

# (block_n, block_k, num_warps, num_stages, TMA loads); the first of each is the launcher's default
EXPERT_CONFIGS = [
    (64, 64, 4, 3, False), (128, 64, 4, 2, False), (128, 64, 8, 2, False), (64, 64, 4, 3, True),
    (64, 64, 4, 4, True), (64, 64, 8, 3, True), (128, 64, 8, 2, True), (128, 64, 8, 3, True), (64, 128, 4, 2, True)]
DOWN_CONFIGS = [  # the experts' down projection in Triton, against cuBLAS's batched GEMM
    (64, 64, 4, 3, False), (128, 64, 4, 3, False), (128, 64, 8, 3, False), (64, 64, 4, 3, True),
    (128, 64, 4, 3, True), (128, 64, 8, 3, True), (128, 64, 8, 4, True), (256, 64, 8, 3, True)]
# The routed form's tilings (block_n, block_t, block_k, num_warps, num_stages, TMA weights); the first is the
# launchers' default (block_t 0: their rule, 16 rows up to 8 an expert on average, else 32)
ROUTED_CONFIGS = [
    (64, 0, 64, 4, 4, True), (64, 32, 64, 4, 4, True), (128, 16, 64, 4, 3, True), (64, 16, 128, 4, 3, True),
    (64, 16, 64, 4, 6, True), (64, 16, 64, 4, 4, False)]
ROUTED_DOWN_CONFIGS = [
    (64, 0, 64, 4, 4, True), (64, 32, 64, 4, 4, True), (128, 16, 64, 4, 3, True), (64, 16, 128, 4, 3, True),
    (64, 16, 64, 4, 4, False)]
MLA_VARIANTS = [  # mla_decode_paged tuning at the serve pool's 1024-token pages; {} = the launcher's rule
    {}, {"num_splits": 2}, {"num_splits": 8}, {"num_splits": 16}, {"block_n": 32, "num_stages": 3},
    {"block_n": 32, "num_stages": 3, "num_splits": 8}, {"num_warps": 8}, {"tokens_major": True}]
MLA_CONTEXTS = (1024, 4096)
WEIGHT_COPIES = 3  # distinct weight sets cycled through the timed calls: 300 MB, far past the 50 MB L2
Case = tuple[Callable[[], object], Callable[[], object] | None, int]  # fused, peer, weight bytes read per call


def weight_copies(shape: tuple[int, ...], gen: torch.Generator, count: int = WEIGHT_COPIES) -> list[torch.Tensor]:
    """`count` random bf16 weights of `shape`, to cycle through (each timed form its own cycle, both
    starting at the first copy, so their first outputs compare on equal inputs)."""
    return [(torch.randn(shape, device=gen.device, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)
            for _ in range(count)]


def each_call(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> Callable[[], object]:
    cycle = itertools.cycle(weights)
    return lambda: fn(next(cycle))


def expert_cases(c: K3Config, tokens: int, gen: torch.Generator, configs: list[tuple[int, ...]]) -> dict[str, Case]:
    """The dense experts' gate|up GEMM + GLU per block shape, against cuBLAS + the SiTU kernel."""
    experts, ffn, latent = c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size
    z = torch.randn(tokens, 4 * latent, device=gen.device, generator=gen).to(torch.bfloat16)[:, :latent]
    w13s, beta = weight_copies((experts, 2 * ffn, latent), gen), (c.situ_beta, c.situ_linear_beta)

    def cublas(w13: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(z, w13.view(experts * 2 * ffn, latent)).view(tokens * experts, 2 * ffn)
        return situ_glu_triton.situ_glu_fused(gate_up, *beta).view(tokens, experts, ffn).transpose(0, 1)

    return {f"expert_gate_up_glu n{n} k{k} w{warps} s{stages}{' tma' if tma else ''}": (
        each_call(lambda w, t=(n, k, warps, stages, tma): expert_gemm_triton.expert_gate_up_glu(
            z, w, "situ", *beta, block_n=t[0], block_k=t[1], num_warps=t[2], num_stages=t[3], tma=t[4]), w13s),
        each_call(cublas, w13s), experts * 2 * ffn * latent * 2) for n, k, warps, stages, tma in configs}


def default_tiles(configs: list[tuple]) -> list[tuple]:
    """Outside the sweep: the launcher's default tile (the first) in both load forms."""
    return [c for c in configs if c[:4] == configs[0][:4]]


def down_cases(c: K3Config, tokens: int, gen: torch.Generator, configs: list[tuple]) -> dict[str, Case]:
    """The dense experts' down projection act [E, T, F] @ w2 [E, l, F]^T in Triton, against cuBLAS's bmm."""
    experts, ffn, latent = c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size
    act = torch.randn(experts, tokens, ffn, device=gen.device, generator=gen).to(torch.bfloat16)
    w2s = weight_copies((experts, latent, ffn), gen, 2 * WEIGHT_COPIES)
    return {f"expert_down n{n} k{k} w{warps} s{stages}{' tma' if tma else ''}": (
        each_call(lambda w, t=(n, k, warps, stages, tma): expert_gemm_triton.expert_down(
            act, w, block_n=t[0], block_k=t[1], num_warps=t[2], num_stages=t[3], tma=t[4]), w2s),
        each_call(lambda w: torch.bmm(act, w.transpose(1, 2)), w2s), experts * latent * ffn * 2)
        for n, k, warps, stages, tma in configs}


def routing(c: K3Config, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """The routing [T, k] of `tokens` random tokens through a random router (a spread like the bench's feed,
    never one token for every row)."""
    x = torch.randn(tokens, c.hidden_size, device=gen.device, generator=gen).to(torch.bfloat16)
    router = (torch.randn(c.num_experts, c.hidden_size, device=gen.device, generator=gen)
              / c.hidden_size ** 0.5).to(torch.bfloat16)
    return naive.moe_route(x, router, None, c.num_experts_per_token)[1]


def routed_expert_cases(c: K3Config, tokens: int, gen: torch.Generator, configs: list[tuple],
                        down_configs: list[tuple]) -> dict[str, Case]:
    """The routed experts' gate|up + GLU and down projection per tiling, each against torch._grouped_mm over the
    same rows (+ the SiTU kernel for the gate|up); weight bytes: every expert's (what the dense form reads)."""
    experts, ffn, latent = c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size
    indices = routing(c, tokens, gen)
    rows_token, offsets, _ = naive.moe_align(indices, experts)  # the grouped GEMM's rows (the peer)
    z = torch.randn(tokens, 4 * latent, device=gen.device, generator=gen).to(torch.bfloat16)[:, :latent]
    act = torch.randn(rows_token.shape[0], ffn, device=gen.device, generator=gen).to(torch.bfloat16)
    w13s, beta = weight_copies((experts, 2 * ffn, latent), gen), (c.situ_beta, c.situ_linear_beta)
    w2s = weight_copies((experts, latent, ffn), gen, 2 * WEIGHT_COPIES)

    def grouped_gate_up(w13: torch.Tensor) -> torch.Tensor:
        gate_up = torch._grouped_mm(z[rows_token], w13.transpose(1, 2), offs=offsets)
        return situ_glu_triton.situ_glu_fused(gate_up, *beta)

    found: dict[str, Case] = {}
    for n, t, k, warps, stages, tma in configs:
        tiling = dict(block_n=n, block_t=t, block_k=k, num_warps=warps, num_stages=stages, tma=tma)
        label = f"n{n} t{t or 'auto'} k{k} w{warps} s{stages}{' tma' if tma else ''}"
        found[f"routed_gate_up_glu {label}"] = (
            each_call(lambda w, tiling=tiling: routed_expert_gemm_triton.routed_expert_gate_up_glu(
                z, w, indices, "situ", *beta, **tiling)[0], w13s),
            each_call(grouped_gate_up, w13s), experts * 2 * ffn * latent * 2)
    for n, t, k, warps, stages, tma in down_configs:
        tiling = dict(block_n=n, block_t=t, block_k=k, num_warps=warps, num_stages=stages, tma=tma)
        found[f"routed_down n{n} t{t or 'auto'} k{k} w{warps} s{stages}{' tma' if tma else ''}"] = (
            each_call(lambda w, tiling=tiling: routed_expert_gemm_triton.routed_expert_down(
                act, w, indices, **tiling), w2s),
            each_call(lambda w: torch._grouped_mm(act, w.transpose(1, 2), offs=offsets), w2s),
            experts * latent * ffn * 2)
    return found


def mla_cases(c: K3Config, batch: int, gen: torch.Generator, variants: list[dict]) -> dict[str, Case]:
    """The paged MLA decode (split-KV) at the serve pool's page size, `batch` sequences at each of
    MLA_CONTEXTS, per tuning, against the launcher's rule; latents cycled through enough copies of the
    cache to come from HBM. "weight" bytes here: the latent rows read."""
    rank, rope, heads, page = c.kv_lora_rank, c.qk_rope_head_dim, c.num_attention_heads, 1024
    scale = (c.qk_nope_head_dim + rope) ** -0.5
    found: dict[str, Case] = {}
    for ctx in MLA_CONTEXTS:
        pages = batch * ctx // page
        copies = max(2, -(-200_000_000 // (pages * page * (rank + rope) * 2)))
        caches = [torch.randn(pages, page, rank + rope, device=gen.device, generator=gen).to(torch.bfloat16)
                  for _ in range(copies)]
        table = torch.randperm(pages, device=gen.device, generator=gen).view(batch, -1).to(torch.int32)
        q = torch.randn(batch, heads, rank + rope, device=gen.device, generator=gen).to(torch.bfloat16)
        step = (q, table, torch.full((batch,), ctx, device=gen.device, dtype=torch.int32))
        for v in variants:
            name = ",".join(f"{k}={val}" for k, val in v.items()) or "rule"
            found[f"mla_decode_paged ctx{ctx} {name}"] = (
                each_call(lambda cache, v=v, a=step: decode_triton.mla_decode_paged(
                    a[0], cache, a[1], a[2], scale, rank, **v), caches),
                each_call(lambda cache, a=step: decode_triton.mla_decode_paged(a[0], cache, a[1], a[2], scale, rank),
                          caches), batch * ctx * (rank + rope) * 2)
    return found
