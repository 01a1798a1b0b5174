"""Mapping between K3Config and the Hugging Face config.json keys (Kimi Linear names + K3 extensions)."""

from __future__ import annotations

from typing import Any

from k3core.config import ConfigError, K3Config

# HF key -> K3Config field, for the flat keys that keep their meaning.
_FLAT_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "mla_use_nope": "mla_use_nope",
    "mla_use_output_gate": "mla_use_output_gate",
    "intermediate_size": "intermediate_size",
    "hidden_act": "hidden_act",
    "activation_situ_beta": "situ_beta",
    "activation_situ_linear_beta": "situ_linear_beta",
    "num_experts": "num_experts",
    "num_experts_per_token": "num_experts_per_token",
    "num_shared_experts": "num_shared_experts",
    "moe_intermediate_size": "moe_intermediate_size",
    "first_k_dense_replace": "first_k_dense_replace",
    "moe_layer_freq": "moe_layer_freq",
    "moe_renormalize": "moe_renormalize",
    "routed_scaling_factor": "routed_scaling_factor",
    "routed_expert_hidden_size": "routed_expert_hidden_size",
    "latent_moe_use_norm": "latent_moe_use_norm",
    "attn_res_block_size": "attn_res_block_size",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
}
# Keys whose value is implied by the model we build; accepted, checked, not stored.
_IMPLIED = {"model_type": "kimi_linear", "moe_router_activation_func": "sigmoid"}
_LINEAR_KEYS = {"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"}
_LINEAR_EXT = {"gate_lower_bound", "lower_bound", "safe_gate", "use_full_rank_gate"}


def _one_based(values: Any, name: str, num_layers: int) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(isinstance(v, int) for v in values):
        raise ConfigError(
            f"linear_attn_config.{name} must be a list of 1-based layer numbers, got {values!r}"
        )
    bad = [v for v in values if not 1 <= v <= num_layers]
    if bad:
        raise ConfigError(f"linear_attn_config.{name} has layers outside 1..{num_layers}: {bad}")
    return tuple(v - 1 for v in values)


def config_from_hf(cls: type[K3Config], raw: dict[str, Any]) -> K3Config:
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    wrapper = None
    if "text_config" in raw:
        wrapper = {k: v for k, v in raw.items() if k != "text_config"}
        raw = raw["text_config"]
        if not isinstance(raw, dict):
            raise ConfigError("text_config must be a JSON object")
    for key, expected in _IMPLIED.items():
        if key in raw and raw[key] != expected:
            raise ConfigError(f"{key} must be {expected!r}, got {raw[key]!r}")
    linear = raw.get("linear_attn_config")
    if not isinstance(linear, dict):
        raise ConfigError("linear_attn_config is required (an object with kda_layers, full_attn_layers, ...)")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if k not in raw]
    missing += [
        f"linear_attn_config.{k}"
        for k in ("kda_layers", "full_attn_layers", "num_heads", "head_dim")
        if k not in linear
    ]
    if missing:
        raise ConfigError(f"config.json lacks required keys: {missing}")
    num_layers = raw["num_hidden_layers"]
    kwargs: dict[str, Any] = {field: raw[key] for key, field in _FLAT_KEYS.items() if key in raw}
    kwargs.update(
        kda_layers=_one_based(linear["kda_layers"], "kda_layers", num_layers),
        mla_layers=_one_based(linear["full_attn_layers"], "full_attn_layers", num_layers),
        kda_num_heads=linear["num_heads"],
        kda_head_dim=linear["head_dim"],
        short_conv_kernel_size=linear.get("short_conv_kernel_size", 4),
        # released Kimi Linear configs carry no bound: their gate is the softplus one
        gate_lower_bound=linear.get("gate_lower_bound", linear.get("lower_bound")),
        use_full_rank_gate=linear.get("use_full_rank_gate", False),
        mla_use_output_gate=raw.get("mla_use_output_gate", False),
        hidden_act=raw.get("hidden_act", "silu"),
    )
    known = set(_FLAT_KEYS) | set(_IMPLIED) | {"linear_attn_config"}
    extra = {k: v for k, v in raw.items() if k not in known}
    linear_extra = {k: v for k, v in linear.items() if k not in _LINEAR_KEYS | _LINEAR_EXT}
    if linear_extra:
        extra["linear_attn_config"] = linear_extra
    try:
        return cls(**kwargs, extra=extra, wrapper=wrapper)
    except TypeError as exc:  # a value of the wrong JSON type reached a comparison
        raise ConfigError(f"config.json has a value of the wrong type: {exc}") from exc


def config_to_hf(c: K3Config) -> dict[str, Any]:
    out: dict[str, Any] = dict(c.extra)
    out.pop("linear_attn_config", None)
    out.update({key: getattr(c, field) for key, field in _FLAT_KEYS.items()})
    out.update(_IMPLIED)
    linear = dict(c.extra.get("linear_attn_config", {}))
    linear.update(
        kda_layers=[i + 1 for i in c.kda_layers],
        full_attn_layers=[i + 1 for i in c.mla_layers],
        num_heads=c.kda_num_heads,
        head_dim=c.kda_head_dim,
        short_conv_kernel_size=c.short_conv_kernel_size,
        use_full_rank_gate=c.use_full_rank_gate,
    )
    if c.gate_lower_bound is not None:
        linear["gate_lower_bound"] = c.gate_lower_bound
    out["linear_attn_config"] = linear
    if c.wrapper is not None:
        return {**c.wrapper, "text_config": out}
    return out
