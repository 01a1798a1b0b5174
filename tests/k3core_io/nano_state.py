"""A state dict with the released Kimi Linear names and K3 extension names at `nano` shape, built by
hand from the config (independent of k3core.model, so the checkpoint code is tested against the names
the release uses rather than against itself)."""

from __future__ import annotations

import torch

from k3core.config import K3Config
from k3core.presets import preset


def small_config() -> K3Config:
    """The nano preset's layout at pinned small sizes, so hand-computed shapes in these tests do not
    move when the preset is retuned."""
    return preset("nano").replace(
        hidden_size=64, kda_num_heads=2, kda_head_dim=16, num_attention_heads=2, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
        num_experts=8, num_experts_per_token=2, num_shared_experts=2, moe_intermediate_size=32,
        routed_expert_hidden_size=32,
    )  # fmt: skip


def nano_state_dict(c: K3Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    hdim, proj, heads = c.hidden_size, c.kda_projection_size, c.kda_num_heads
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (hdim,)
        shapes[p + "post_attention_layernorm.weight"] = (hdim,)
        shapes[p + "attn_res_attn.query"] = (hdim,)
        shapes[p + "attn_res_attn.norm.weight"] = (hdim,)
        a = p + "self_attn."
        if c.layer_kind(layer) == "kda":
            for n in ("q", "k", "v"):
                shapes[a + f"{n}_proj.weight"] = (proj, hdim)
                shapes[a + f"{n}_conv1d.weight"] = (proj, 1, c.short_conv_kernel_size)
            shapes[a + "A_log"] = (1, 1, heads, 1)
            shapes[a + "dt_bias"] = (proj,)
            shapes[a + "f_a_proj.weight"] = (c.kda_head_dim, hdim)
            shapes[a + "f_b_proj.weight"] = (proj, c.kda_head_dim)
            shapes[a + "b_proj.weight"] = (heads, hdim)
            shapes[a + "g_proj.weight"] = (proj, hdim)
            shapes[a + "o_norm.weight"] = (c.kda_head_dim,)
            shapes[a + "o_proj.weight"] = (hdim, proj)
        else:
            nh, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
            assert c.q_lora_rank is not None
            shapes[a + "q_a_proj.weight"] = (c.q_lora_rank, hdim)
            shapes[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (nh * qk, c.q_lora_rank)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, hdim)
            shapes[a + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
            shapes[a + "kv_b_proj.weight"] = (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            shapes[a + "g_proj.weight"] = (nh * c.v_head_dim, hdim)
            shapes[a + "o_proj.weight"] = (hdim, nh * c.v_head_dim)
        if not c.is_moe_layer(layer):
            for n in ("gate_proj", "up_proj"):
                shapes[p + f"mlp.{n}.weight"] = (c.intermediate_size, hdim)
            shapes[p + "mlp.down_proj.weight"] = (hdim, c.intermediate_size)
            continue
        m, width, inter = p + "block_sparse_moe.", c.routed_width, c.moe_intermediate_size
        shapes[m + "gate.weight"] = (c.num_experts, hdim)
        shapes[m + "gate.e_score_correction_bias"] = (c.num_experts,)
        for e in range(c.num_experts):
            shapes[m + f"experts.{e}.w1.weight"] = (inter, width)
            shapes[m + f"experts.{e}.w3.weight"] = (inter, width)
            shapes[m + f"experts.{e}.w2.weight"] = (width, inter)
        shapes[m + "routed_expert_down_proj.weight"] = (width, hdim)
        shapes[m + "routed_expert_up_proj.weight"] = (hdim, width)
        shapes[m + "routed_expert_norm.weight"] = (width,)
        shared = inter * c.num_shared_experts
        shapes[m + "shared_experts.gate_proj.weight"] = (shared, hdim)
        shapes[m + "shared_experts.up_proj.weight"] = (shared, hdim)
        shapes[m + "shared_experts.down_proj.weight"] = (hdim, shared)
    shapes["model.norm.weight"] = (hdim,)
    shapes["lm_head.weight"] = (c.vocab_size, hdim)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in shapes.items()}
