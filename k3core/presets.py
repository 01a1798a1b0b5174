"""Named model shapes.

- `nano`: a few M parameters, K3's shape in miniature (blocks of 3 KDA + 1 MLA plus a final MLA layer,
  bounded gate, full-rank gates, Block AttnRes with an incomplete last block, latent MoE with SiTU-GLU
  and 2 shared experts), byte-level vocabulary; CPU tests in seconds.
- `mini`: ~2.4B parameters of the same shape, for GPU benchmarks on one H200.
- `nano-kl`, `mini-kl`: the same sizes in the Kimi Linear form (softplus gate, low-rank output gate, no
  MLA output gate, plain MoE with SiLU, no AttnRes), loadable by Kimi Linear code.
- `kimi-linear-48b`: the released Kimi-Linear-48B-A3B shape.
- `k3`: Kimi K3 (93 layers: 69 KDA, 24 MLA). Shape math only, never instantiated. Numbers from the close
  reading's config.json cross-checks (seeds/003); MLA heads (96) and q_lora_rank (1536) are solved from its
  parameter count (24 MLA layers ~5.6B), the dense intermediate size from its 0.73B dense layer.
"""

from __future__ import annotations

from k3core.config import ConfigError, K3Config
from k3core.tokenizer.byte_level import BYTE_SPECIALS, BYTE_VOCAB


def hybrid_layout(num_blocks: int, final_mla: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """0-based (kda_layers, mla_layers) for blocks of 3 KDA + 1 MLA, plus an optional final MLA layer."""
    total = 4 * num_blocks + int(final_mla)
    mla = tuple(i for i in range(total) if i % 4 == 3 or (final_mla and i == total - 1))
    return tuple(i for i in range(total) if i not in mla), mla


def _kimi_linear_form(c: K3Config) -> K3Config:
    """The same sizes with every K3 extension switched off (Kimi Linear compatible)."""
    return c.replace(
        gate_lower_bound=None,
        use_full_rank_gate=False,
        mla_use_output_gate=False,
        hidden_act="silu",
        routed_expert_hidden_size=None,
        attn_res_block_size=None,
        q_lora_rank=None,
    )


def _nano() -> K3Config:
    kda, mla = hybrid_layout(2)
    return K3Config(
        vocab_size=BYTE_VOCAB + len(BYTE_SPECIALS), hidden_size=128, num_hidden_layers=len(kda) + len(mla),
        kda_layers=kda, mla_layers=mla, kda_num_heads=4, kda_head_dim=32, short_conv_kernel_size=4,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, intermediate_size=384, num_experts=16, num_experts_per_token=4, num_shared_experts=2,
        moe_intermediate_size=96, first_k_dense_replace=1, routed_expert_hidden_size=64,
        attn_res_block_size=4, rms_norm_eps=1e-6, bos_token_id=BYTE_SPECIALS["[BOS]"], eos_token_id=BYTE_SPECIALS["[EOS]"],
    )  # fmt: skip


def _mini() -> K3Config:
    kda, mla = hybrid_layout(4)
    return K3Config(
        vocab_size=163840, hidden_size=2048, num_hidden_layers=len(kda) + len(mla),
        kda_layers=kda, mla_layers=mla, kda_num_heads=16, kda_head_dim=128,
        num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=5632, num_experts=32, num_experts_per_token=4, num_shared_experts=2,
        moe_intermediate_size=768, first_k_dense_replace=1, routed_expert_hidden_size=1024,
        attn_res_block_size=8,
    )  # fmt: skip


def _kimi_linear_48b() -> K3Config:
    kda = tuple(i for i in range(27) if (i + 1) % 4 and i != 26)
    return K3Config(
        vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
        kda_layers=kda, mla_layers=tuple(i for i in range(27) if i not in kda),
        kda_num_heads=32, kda_head_dim=128, gate_lower_bound=None, use_full_rank_gate=False,
        num_attention_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_output_gate=False, intermediate_size=9216, hidden_act="silu",
        num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024,
        first_k_dense_replace=1, routed_scaling_factor=2.446, bos_token_id=163584, eos_token_id=163586,
    )  # fmt: skip


def _k3() -> K3Config:
    kda, mla = hybrid_layout(23)  # 92 layers + the final MLA layer = 93
    return K3Config(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, kda_layers=kda, mla_layers=mla,
        kda_num_heads=96, kda_head_dim=128, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=33792,
        num_experts=896, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        first_k_dense_replace=1, routed_expert_hidden_size=3584, attn_res_block_size=12,
    )  # fmt: skip


_BUILDERS = {
    "nano": _nano,
    "nano-kl": lambda: _kimi_linear_form(_nano()),
    "mini": _mini,
    "mini-kl": lambda: _kimi_linear_form(_mini()),
    "kimi-linear-48b": _kimi_linear_48b,
    "k3": _k3,
}
PRESET_NAMES = tuple(_BUILDERS)


def preset(name: str) -> K3Config:
    try:
        return _BUILDERS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}") from None
