"""The MoE router compiles two kernels for every prompt length, split and unsplit, both of which a worker's
warm-up (a full-budget chunk and an unaligned tail, services/engine/warmup.py) runs: a length whose
divisibility by 16, or whose split count, gave a kernel of its own made the first request of that shape pay a
JIT compile (seen on the H200: bench.serve_ttft's uncached 32K+512 prompt, chunks 8192 and 512 after a
2048+7 warm-up, took 1.67 s against 0.63 s). Specialisations are Triton's own binder's, for sm_90."""

from __future__ import annotations

import torch

from kernels.compile_check import record_launches


def test_every_prompt_length_shares_the_warmed_router_kernels():
    weight = torch.empty(256, 2048, dtype=torch.bfloat16)
    with record_launches() as recorder:
        from kernels.fused.moe_router_triton import moe_route

        def specs_after(tokens: list[int]) -> set:
            for t in tokens:
                moe_route(torch.empty(t, 2048, dtype=torch.bfloat16), weight, None, 8)
            return set(recorder.specs)

        warmed = specs_after([8192, 257])  # the warm-up's chunks at mini's budget and 512-token hash blocks
        assert len(warmed) == 2
        # decode buckets, hash-aligned remainders, odd first chunks, three-way-split sizes, long unaligned ones
        assert specs_after([1, 7, 16, 64, 256, 512, 1500, 2048, 2055, 4224, 5000, 32768]) == warmed
