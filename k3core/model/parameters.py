"""Every parameter of a K3Model, by checkpoint name and shape, computed from the config alone.

This is the name table of docs/model.md in code: the weights loader maps checkpoint tensors onto it, the
planner sizes models that are never instantiated (k3: 2.8T parameters), and a test checks it against the
real module tree.
"""

from __future__ import annotations

import math

from k3core.config import K3Config

Shapes = dict[str, tuple[int, ...]]


def _glu(prefix: str, dim: int, inter: int, names: tuple[str, str, str]) -> Shapes:
    gate, up, down = names
    return {
        f"{prefix}.{gate}.weight": (inter, dim),
        f"{prefix}.{up}.weight": (inter, dim),
        f"{prefix}.{down}.weight": (dim, inter),
    }


def _kda(c: K3Config, p: str) -> Shapes:
    d, proj, hd, w = c.hidden_size, c.kda_projection_size, c.kda_head_dim, c.short_conv_kernel_size
    out = {f"{p}.{n}_proj.weight": (proj, d) for n in ("q", "k", "v")}
    out.update({f"{p}.{n}_conv1d.weight": (proj, 1, w) for n in ("q", "k", "v")})
    out.update({
        f"{p}.A_log": (1, 1, c.kda_num_heads, 1), f"{p}.dt_bias": (proj,),
        f"{p}.f_a_proj.weight": (hd, d), f"{p}.f_b_proj.weight": (proj, hd),
        f"{p}.b_proj.weight": (c.kda_num_heads, d),
        f"{p}.o_norm.weight": (hd,), f"{p}.o_proj.weight": (d, proj),
    })  # fmt: skip
    if c.use_full_rank_gate:
        out[f"{p}.g_proj.weight"] = (proj, d)
    else:
        out.update({f"{p}.g_a_proj.weight": (hd, d), f"{p}.g_b_proj.weight": (proj, hd)})
    return out


def _mla(c: K3Config, p: str) -> Shapes:
    d, h = c.hidden_size, c.num_attention_heads
    q_width = h * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    out: Shapes = {}
    if c.q_lora_rank is not None:
        out.update({
            f"{p}.q_a_proj.weight": (c.q_lora_rank, d), f"{p}.q_a_layernorm.weight": (c.q_lora_rank,),
            f"{p}.q_b_proj.weight": (q_width, c.q_lora_rank),
        })  # fmt: skip
    else:
        out[f"{p}.q_proj.weight"] = (q_width, d)
    out.update({
        f"{p}.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, d),
        f"{p}.kv_a_layernorm.weight": (c.kv_lora_rank,),
        f"{p}.kv_b_proj.weight": (h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        f"{p}.o_proj.weight": (d, h * c.v_head_dim),
    })  # fmt: skip
    if c.mla_use_output_gate:
        out[f"{p}.g_proj.weight"] = (h * c.v_head_dim, d)
    return out


def _moe(c: K3Config, p: str) -> Shapes:
    d, width = c.hidden_size, c.routed_width
    out: Shapes = {
        f"{p}.gate.weight": (c.num_experts, d),
        f"{p}.gate.e_score_correction_bias": (c.num_experts,),
    }
    for e in range(c.num_experts):
        out.update(_glu(f"{p}.experts.{e}", width, c.moe_intermediate_size, ("w1", "w3", "w2")))
    if c.num_shared_experts:
        shared = c.moe_intermediate_size * c.num_shared_experts
        out.update(_glu(f"{p}.shared_experts", d, shared, ("gate_proj", "up_proj", "down_proj")))
    if c.uses_latent_moe:
        out[f"{p}.routed_expert_down_proj.weight"] = (width, d)
        out[f"{p}.routed_expert_up_proj.weight"] = (d, width)
        if c.latent_moe_use_norm:
            out[f"{p}.routed_expert_norm.weight"] = (width,)
    return out


def parameter_shapes(c: K3Config) -> Shapes:
    d = c.hidden_size
    out: Shapes = {"model.embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (d,)
        out[f"{p}.post_attention_layernorm.weight"] = (d,)
        out.update(_kda(c, f"{p}.self_attn") if c.layer_kind(i) == "kda" else _mla(c, f"{p}.self_attn"))
        if c.is_moe_layer(i):
            out.update(_moe(c, f"{p}.block_sparse_moe"))
        else:
            out.update(_glu(f"{p}.mlp", d, c.intermediate_size, ("gate_proj", "up_proj", "down_proj")))
        if c.uses_attn_res:
            for site in ("attn", "mlp"):
                out[f"{p}.attn_res.{site}.query"] = (d,)
                out[f"{p}.attn_res.{site}.norm.weight"] = (d,)
    out["model.norm.weight"] = (d,)
    if c.uses_attn_res:
        out["model.attn_res_final.query"] = (d,)
        out["model.attn_res_final.norm.weight"] = (d,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, d)
    return out


def parameter_count(c: K3Config) -> int:
    return sum(math.prod(shape) for shape in parameter_shapes(c).values())
