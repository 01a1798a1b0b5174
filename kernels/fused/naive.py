"""Plain-torch references of the fused decode-glue kernels (what `kernels.dispatch` runs off CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.ops.mla import sigmoid_output_gate
from k3core.ops.moe import sigmoid_router, situ_glu, swiglu
from k3core.ops.norm import rms_norm

ACTIVATIONS = ("situ", "swiglu")


def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
              renormalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid router of tokens x [T, H] with weight [E, H]: logits in float32 (MoEGate's x.float() @ W^T),
    sigmoid, + bias, top-k, weights from the unbiased scores, renormalise, scale (k3core's `sigmoid_router`)
    -> (weights [T, k] float32, expert ids [T, k])."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    return sigmoid_router(F.linear(x.to(dtype), weight.to(dtype)), top_k, bias, renormalize, scaling)


def expert_gate_up_glu(z: torch.Tensor, w13: torch.Tensor, activation: str = "situ", beta1: float = 4.0,
                       beta2: float = 25.0) -> torch.Tensor:
    """Every expert's gate|up GEMM and GLU: z [T, l], w13 [E, 2F, l] (each expert's gate rows, then up rows)
    -> act [E, T, F]."""
    experts, two_f, width = w13.shape
    gate_up = F.linear(z, w13.reshape(experts * two_f, width)).view(z.shape[0], experts, two_f)
    return glu(gate_up, activation, beta1, beta2).transpose(0, 1).contiguous()


def expert_down(act: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Every expert's down projection: act [E, T, F] @ w2 [E, l, F]^T -> [E, T, l]."""
    return torch.bmm(act, w2.transpose(1, 2))


def moe_align(indices: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of indices [T, k] sorted by expert, ties by pair id (t*k + j): (token of each
    sorted row [T*k] int64, cumulative row count per expert [E] int32: grouped-GEMM offsets, sorted row of
    each pair [T, k] int64)."""
    flat = indices.reshape(-1).to(torch.int64)
    pairs = torch.arange(flat.numel(), device=indices.device)
    order = torch.sort(flat * flat.numel() + pairs).indices  # unique keys: the sort is stable by construction
    counts = torch.zeros(experts, dtype=torch.int32, device=indices.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    position = torch.empty_like(order).scatter_(0, order, pairs)
    return order // indices.shape[1], torch.cumsum(counts, 0, dtype=torch.int32), position.view(indices.shape)


Padding = tuple[torch.Tensor, int]  # (marker [T], value): the tokens whose marker is the value are padding rows


def routed_expert_gate_up_glu(z: torch.Tensor, w13: torch.Tensor, indices: torch.Tensor, activation: str = "situ",
                              beta1: float = 4.0, beta2: float = 25.0,
                              padding: Padding | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each routed pair's gate|up GEMM and GLU, rows sorted by expert (moe_align's order): row r, the pair
    (t, j) of expert e, is the GLU of w13[e] @ z[t] -> (act [T*k, F], the row of each pair [T, k]). The dense
    form's rows picked (`expert_gate_up_glu`: E x T products, not every pair against every expert's weights).
    `padding`: its tokens are routed to no expert (a CUDA graph bucket's padding rows): the other pairs take
    the first rows in the same order (the rows after them are zeros), the padding pairs' row is T*k, the zero
    row `routed_expert_down` adds with `padding`."""
    rows_token, rows_expert, live, position = _sorted_pairs(indices, w13.shape[0], padding)
    act = expert_gate_up_glu(z, w13, activation, beta1, beta2)[rows_expert, rows_token]
    return (act if live is None else torch.where(live[:, None], act, 0)), position


def routed_expert_down(act: torch.Tensor, w2: torch.Tensor, indices: torch.Tensor,
                       padding: Padding | None = None) -> torch.Tensor:
    """Each routed pair's down projection: row r of act [T*k, F] (sorted by expert, as
    routed_expert_gate_up_glu gives them) times its expert's w2[e]^T -> [T*k, l]. The rows placed in the dense
    form's [E, T, F] (zeros elsewhere) through `expert_down`, and picked back. With `padding` (as
    routed_expert_gate_up_glu's) [T*k + 1, l]: the padding pairs' rows (the last) and row T*k zeros."""
    rows_token, rows_expert, live, _ = _sorted_pairs(indices, w2.shape[0], padding)
    if live is not None:  # a padding token's slots hold zeros: its pairs (the only writers there) write zeros
        act = torch.where(live[:, None], act, 0)
    dense = act.new_zeros(w2.shape[0], indices.shape[0], act.shape[1])
    dense[rows_expert, rows_token] = act
    out = expert_down(dense, w2)[rows_expert, rows_token]
    if live is None:
        return out
    return torch.cat([torch.where(live[:, None], out, 0), out.new_zeros(1, out.shape[1])])


def _sorted_pairs(indices: torch.Tensor, experts: int,
                  padding: Padding | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """moe_align's rows for the routed references: (token, expert and, with padding, whether routed, of each
    row; the row of each pair). Padding pairs sort last as an expert past the last (their expert clamped to
    the last: a slot of their own token, which no routed pair shares); their position is T*k. No host sync."""
    if padding is None:
        rows_token, _, position = moe_align(indices, experts)
        return rows_token, torch.sort(indices.reshape(-1).to(torch.int64)).values, None, position
    pad = padding[0] == padding[1]
    ids = torch.where(pad[:, None], experts, indices.to(torch.int64))
    rows_token, _, position = moe_align(ids, experts + 1)
    rows_expert = torch.sort(ids.reshape(-1)).values
    return rows_token, rows_expert.clamp(max=experts - 1), rows_expert < experts, \
        torch.where(pad[:, None], indices.numel(), position)


def picked_rows(index: torch.Tensor, index_stride: int, token_stride: int) -> torch.Tensor:
    """Row ids [T, K] of `rows` that `moe_combine` reads: index * index_stride + token * token_stride."""
    tokens = torch.arange(index.shape[0], device=index.device).unsqueeze(1)
    return index.to(torch.int64) * index_stride + tokens * token_stride


def glu(gate_up: torch.Tensor, activation: str, beta1: float, beta2: float) -> torch.Tensor:
    """[..., 2F] (gate | up) -> [..., F] with the named activation."""
    require_activation(activation)
    width = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :width], gate_up[..., width:]
    return situ_glu(gate, up, beta1, beta2) if activation == "situ" else swiglu(gate, up)


def require_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def moe_combine(rows: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, index_stride: int,
                token_stride: int, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                shared_gate_up: torch.Tensor | None = None, activation: str = "situ", beta1: float = 4.0,
                beta2: float = 25.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The routed experts' outputs summed per token, then the latent RMSNorm, then the shared experts' GLU.

    rows [R, l]: expert output rows; token t's j-th pick is row index[t, j] * index_stride + t * token_stride,
    weighted by weight[t, j] (float32) and summed in float32, rounded to `out_dtype` (default rows.dtype),
    RMS-normalised with `norm_weight` if given. With `shared_gate_up` [T, 2F] the result is [T, l + F]: the
    normalised sum, then the shared experts' activation (the input of one GEMM against the concatenated
    up-projection and shared down-projection weights)."""
    out_dtype = rows.dtype if out_dtype is None else out_dtype
    picked = rows[picked_rows(index, index_stride, token_stride)]  # [T, K, l]
    acc = torch.promote_types(weight.dtype, torch.float32)
    routed = (picked.to(acc) * weight.to(acc).unsqueeze(-1)).sum(1).to(out_dtype)
    if norm_weight is not None:
        routed = rms_norm(routed, norm_weight, eps)
    if shared_gate_up is None:
        return routed
    return torch.cat([routed, glu(shared_gate_up, activation, beta1, beta2).to(out_dtype)], dim=-1)


def mla_latent_write(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, rows: torch.Tensor,
                     write_rows: torch.Tensor, row_offset: int = 0) -> None:
    """Gated MLA's new latent rows into the pool, in place: kv [B, R+P] (the compressed KV projection, latent
    R then rope P) -> rows[write_rows[b] + row_offset] = [RMSNorm(kv[b, :R]) | kv[b, R:]] in rows' dtype."""
    rank = norm_weight.shape[0]
    latent = torch.cat([rms_norm(kv[:, :rank], norm_weight, eps), kv[:, rank:]], dim=-1)
    rows.index_copy_(0, write_rows + row_offset, latent.to(rows.dtype))


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of each row of x [M, D] (any row stride) -> a new contiguous [M, D] in x's dtype (float32 math)."""
    return rms_norm(x, weight, eps)


def gated_heads(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated MLA's output gate on head-major values: o [H, B, Dv], gate [B, H*Dv] -> [B, H*Dv] =
    o (token-major) * sigmoid(gate), computed in float32+, in o's dtype (k3core's sigmoid_output_gate)."""
    heads, batch, width = o.shape
    return sigmoid_output_gate(o.transpose(0, 1), gate.reshape(batch, heads, width)).reshape(batch, heads * width)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """A projection x [M, K] @ weight [N, K]^T -> [M, N], or `residual` [M, N] += x @ weight^T in place in the
    GEMM's epilogue (one launch: the out-of-place addmm copies the residual first), returned."""
    if residual is None:
        return F.linear(x, weight)
    return residual.addmm_(x, weight.t())


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy draw: logits [R, V] -> int64 [R], the lowest index of each row's maximum (NaN beats every
    number: the first NaN), i.e. `torch.argmax`; written into `out` if given."""
    return logits.argmax(-1) if out is None else torch.argmax(logits, -1, out=out)


def lookahead_prologue(tokens: torch.Tensor, kda_slots: torch.Tensor, row_base: torch.Tensor, source: torch.Tensor,
                       stops: torch.Tensor, drawn: torch.Tensor, scratch_kda: int,
                       scratch_base: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode look-ahead step's inputs resolved on the device (services/engine/decode_inputs.py): tokens [B]
    with each row whose source [B] is >= 0 reading drawn[source] (the previous step's draw), and the rows whose
    token is one of their stops [W, B] (a request that stopped on it) pointed at the scratch pages in
    kda_slots [G, B] / row_base [M, B], as padding rows are. New tensors: the inputs are not written (on the
    CPU they may share the host image)."""
    ahead = source >= 0
    tokens = torch.where(ahead, drawn[source.clamp(min=0)], tokens)
    stopped = ((stops == tokens[None]).any(0) & ahead)[None]
    return tokens, kda_slots.masked_fill(stopped, scratch_kda), row_base.masked_fill(stopped, scratch_base)
