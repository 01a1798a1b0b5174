"""Scratch of the fused kernels that split a reduction over programs (`moe_router_triton`,
`skinny_gemm_triton`, `attnres.block_logits_triton`): each program parks its float32 partial tile, and the
last one to arrive at a tile's int32 counter sums the partials and sets the counter back to zero. Launches
on one stream run one after another, so every such kernel shares one buffer pair per device; the engine runs
its forwards on one stream (the graph warm-up's side stream is joined before the capture). Two such kernels
running at once on two streams would race on the counters.
"""

from __future__ import annotations

import torch

from kernels._triton import require

_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced scratch stays allocated: graphs captured earlier still use it
MIN_PARTIALS = 1 << 18  # float32 partials (1 MiB) on CUDA: the router's at 512 tokens fit
MIN_COUNTERS = 4096


def split_scratch(floats: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partials of at least `floats`, int32 counters of at least `tiles`, all zero between launches),
    grown on demand, and only outside CUDA-graph capture: the fast path's warm-up runs every shape eagerly
    before its graph is captured."""
    partials, counters = _SCRATCH.get(device, (None, None))
    if partials is None or counters is None or partials.numel() < floats or counters.numel() < tiles:
        require(not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()),
                "split-kernel scratch must be sized by an eager call before a CUDA graph captures it")
        if partials is not None and counters is not None:
            _OUTGROWN.extend((partials, counters))
        floor = MIN_PARTIALS if device.type == "cuda" else 1
        floats = max(floats, floor, 0 if partials is None else partials.numel())
        tiles = max(tiles, MIN_COUNTERS, 0 if counters is None else counters.numel())
        partials = torch.empty(floats, dtype=torch.float32, device=device)
        counters = torch.zeros(tiles, dtype=torch.int32, device=device)
        _SCRATCH[device] = (partials, counters)
    return partials, counters
