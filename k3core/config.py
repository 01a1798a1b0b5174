"""K3Config: the model's shape, read from and written to a Hugging Face config.json.

Reads the released Kimi Linear format (model_type "kimi_linear", `linear_attn_config` with 1-based
`kda_layers` / `full_attn_layers`) and the K3 extensions (bounded gate, full-rank gates, Block AttnRes,
latent MoE, SiTU), also when the text config is nested under a multimodal wrapper (`text_config`).
Internally layer indices are 0-based. Unknown keys are kept in `extra` and written back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that does not describe a model we can build; the message names the field."""


@dataclass(frozen=True)
class K3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    kda_layers: tuple[int, ...]  # 0-based
    mla_layers: tuple[int, ...]  # 0-based
    # KDA (§2.1.1)
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = -5.0  # None: Kimi Linear's unbounded softplus gate
    use_full_rank_gate: bool = True  # False: Kimi Linear's low-rank g_a_proj/g_b_proj output gate
    # Gated MLA (§2.1.2)
    num_attention_heads: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # MLP / MoE (§2.3)
    intermediate_size: int = 0  # dense layers
    hidden_act: str = "situ"  # "situ" or "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    num_experts: int = 0
    num_experts_per_token: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    routed_expert_hidden_size: int | None = None  # latent MoE width; None: plain MoE at full width
    latent_moe_use_norm: bool = True
    # Block AttnRes (§2.2); None: plain residual stream
    attn_res_block_size: int | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    wrapper: dict[str, Any] | None = field(default=None, compare=False)  # the multimodal outer config

    def __post_init__(self) -> None:
        validate(self)

    # --- derived shape facts -------------------------------------------------------------------
    def layer_kind(self, layer: int) -> str:
        return "kda" if layer in self.kda_layers else "mla"

    def kda_index(self, layer: int) -> int:
        """Position of a KDA layer among KDA layers (the cache's KDA layer index)."""
        return self.kda_layers.index(layer)

    def mla_index(self, layer: int) -> int:
        return self.mla_layers.index(layer)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        )

    @property
    def mla_latent_dim(self) -> int:
        """Values cached per token per MLA layer: normalised c_kv plus the shared (unrotated) k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_projection_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def uses_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def routed_width(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    def replace(self, **changes: Any) -> K3Config:
        return dataclasses.replace(self, **changes)

    # --- Hugging Face config.json ----------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> K3Config:
        from k3core.config_hf import config_from_hf

        return config_from_hf(cls, raw)

    def to_hf_dict(self) -> dict[str, Any]:
        from k3core.config_hf import config_to_hf

        return config_to_hf(self)

    @classmethod
    def from_json_file(cls, path: str | Path) -> K3Config:
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_hf_dict(raw)

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(c: K3Config) -> None:
    """Every check names the offending field, so a bad config.json is fixed without reading code."""
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim"):
        _require(getattr(c, name) > 0, f"{name} must be positive, got {getattr(c, name)}")
    layers = sorted(c.kda_layers + c.mla_layers)
    _require(
        layers == list(range(c.num_hidden_layers)),
        "linear_attn_config.kda_layers and full_attn_layers must together list every layer "
        f"1..{c.num_hidden_layers} exactly once (1-based); got kda={[i + 1 for i in c.kda_layers]}, "
        f"full_attn={[i + 1 for i in c.mla_layers]}",
    )
    _require(
        c.short_conv_kernel_size >= 1, f"short_conv_kernel_size must be >= 1, got {c.short_conv_kernel_size}"
    )
    _require(
        c.gate_lower_bound is None or c.gate_lower_bound < 0,
        f"gate_lower_bound must be negative, got {c.gate_lower_bound}",
    )
    if c.mla_layers:
        _require(
            c.mla_use_nope, "mla_use_nope=false (RoPE MLA) is not supported: K3 and Kimi Linear use NoPE"
        )
        for name in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _require(getattr(c, name) > 0, f"{name} must be positive, got {getattr(c, name)}")
        _require(c.qk_rope_head_dim >= 0, f"qk_rope_head_dim must be >= 0, got {c.qk_rope_head_dim}")
        _require(
            c.q_lora_rank is None or c.q_lora_rank > 0,
            f"q_lora_rank must be positive or null, got {c.q_lora_rank}",
        )
    _require(c.hidden_act in ("situ", "silu"), f"hidden_act must be 'situ' or 'silu', got {c.hidden_act!r}")
    _require(
        c.situ_beta > 0 and c.situ_linear_beta > 0, "activation_situ_beta and _linear_beta must be positive"
    )
    _require(c.moe_layer_freq >= 1, f"moe_layer_freq must be >= 1, got {c.moe_layer_freq}")
    dense_layers = [i for i in range(c.num_hidden_layers) if not c.is_moe_layer(i)]
    if dense_layers:
        _require(c.intermediate_size > 0, f"intermediate_size must be positive (dense layers {dense_layers})")
    if c.num_experts > 0:
        _require(
            1 <= c.num_experts_per_token <= c.num_experts,
            f"num_experts_per_token must be in [1, num_experts={c.num_experts}], got {c.num_experts_per_token}",
        )
        _require(
            c.moe_intermediate_size > 0,
            f"moe_intermediate_size must be positive, got {c.moe_intermediate_size}",
        )
        _require(c.num_shared_experts >= 0, f"num_shared_experts must be >= 0, got {c.num_shared_experts}")
    _require(
        c.routed_expert_hidden_size is None or c.routed_expert_hidden_size > 0,
        f"routed_expert_hidden_size must be positive or null, got {c.routed_expert_hidden_size}",
    )
    _require(
        c.attn_res_block_size is None or c.attn_res_block_size >= 1,
        f"attn_res_block_size must be >= 1 or null, got {c.attn_res_block_size}",
    )
    _require(c.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {c.rms_norm_eps}")
