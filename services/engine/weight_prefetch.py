"""L2 prefetches of a decode step's GEMM weights on a side branch of its captured graph (`K3_DECODE_PREFETCH`).

At batch 64 the output GEMMs (attention out, MoE out: 8-10 MB of weight each, ~30 a step) run at about a
third of copy speed on the H200 (docs/serving.md items 9-13): latency-bound, too few bytes in flight, and
no split-K form beat cuBLAS there. Their weights depend on nothing the step computes, so their bytes can
be pulled into L2 (`dispatch.l2_prefetch`) while the kernels before the GEMM run: the prefetch is queued on
a second stream forked at that point (in the graph a parallel branch), and nothing on the main chain waits
for it until the forward's end (`join`, in `FastDecoder.hidden`).

Groups, a list in K3_DECODE_PREFETCH joined by "," or "+" (read while a forward is captured; unset or "": none):
- "moe-out": the MoE output GEMM's [W_up | W_shared_down], beside `moe_combine` (after the experts' down GEMM);
- "mla-out": the MLA o_proj, beside the value bmm and the output gate (after the attention kernel);
- "kda-out": the KDA o_proj, beside the KDA decode step (its 134 MB of state pass through L2 meanwhile);
- "moe-x": the layer's MoE x GEMM weight, beside the attention's output GEMM and the AttnRes merge;
- "attn-in": the next layer's attention input GEMM weight (KDA 34 MB, MLA 14 MB), beside the MoE output GEMM.
Only while a CUDA graph is captured (an eager forward is host-bound: the launch would cost more than it
hides), but for one eager launch that compiles the kernel before the first capture.
"""

from __future__ import annotations

import os
import re

import torch

from kernels import dispatch

ENV = "K3_DECODE_PREFETCH"
GROUPS = ("moe-out", "mla-out", "kda-out", "moe-x", "attn-in")
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_forked: set[torch.device] = set()  # devices with a prefetch branch not yet joined (this capture)
_warm: set[tuple[torch.device, torch.dtype]] = set()  # (device, weight dtype): the kernel ran once outside a capture


def wanted(group: str) -> bool:
    """Whether K3_DECODE_PREFETCH names `group` (an unknown name raises: a variant's typo must not measure
    the base form)."""
    names = {n for n in re.split(r"[,+]", os.environ.get(ENV, "")) if n}  # "+": a bench.serve --variant value
    unknown = names - set(GROUPS)
    if unknown:
        raise ValueError(f"{ENV}: unknown group(s) {sorted(unknown)}; expected a list of {GROUPS}")
    return group in names


def prefetch(weight: torch.Tensor | None, group: str) -> None:
    """While a CUDA graph is captured and `group` is wanted: an L2 prefetch of `weight` on the prefetch
    branch, after everything queued so far on the current stream (so beside what is queued next). Outside a
    capture only the first wanted call of a device and dtype runs, eagerly: the kernel is compiled and loaded before a
    capture needs it (a graph's warm-up forwards come first)."""
    if weight is None or not weight.is_cuda:
        return
    capturing = torch.cuda.is_current_stream_capturing()
    device = weight.device
    if not capturing and (device, weight.dtype) in _warm or not wanted(group):
        return
    if not capturing:
        _warm.add((device, weight.dtype))
        dispatch.l2_prefetch(weight)
        return
    side = _STREAMS.get(device)
    if side is None:
        side = _STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        dispatch.l2_prefetch(weight)
    _forked.add(device)


def join(x: torch.Tensor) -> None:
    """The current stream of x's device waits for its prefetch branch, if one was forked (a capture must end
    with every forked stream joined)."""
    if x.device in _forked:
        _forked.discard(x.device)
        torch.cuda.current_stream(x.device).wait_stream(_STREAMS[x.device])
