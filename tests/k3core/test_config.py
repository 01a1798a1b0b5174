"""K3Config <-> config.json (released Kimi Linear format, K3 extensions, multimodal wrapper) and presets."""

import json

import pytest

from k3core.config import ConfigError, K3Config
from k3core.model.parameters import parameter_count, parameter_shapes
from k3core.presets import PRESET_NAMES, preset

# The released Kimi-Linear-48B-A3B text config (the keys our loader reads), 1-based layer lists.
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "hidden_act": "silu",
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}


def test_released_kimi_linear_config_reads_as_the_preset():
    config = K3Config.from_hf_dict(KIMI_LINEAR_48B)
    assert config == preset("kimi-linear-48b")
    assert config.gate_lower_bound is None and not config.use_full_rank_gate and not config.uses_attn_res
    assert config.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert config.extra["head_dim"] == 72  # unknown keys survive a round trip
    assert config.to_hf_dict()["head_dim"] == 72


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_round_trips_through_json(name, tmp_path):
    config = preset(name)
    path = tmp_path / "config.json"
    config.save_json(path)
    assert K3Config.from_json_file(path) == config


def test_multimodal_wrapper_is_read_and_written_back():
    text = preset("nano").to_hf_dict()
    raw = {"model_type": "kimi_k3", "vision_config": {"vt_num_hidden_layers": 27}, "text_config": text}
    config = K3Config.from_hf_dict(raw)
    assert config == preset("nano")
    assert config.to_hf_dict() == json.loads(json.dumps(raw))


def test_k3_shape_matches_the_report_and_close_reading():
    k3 = preset("k3")
    assert (k3.num_hidden_layers, len(k3.kda_layers), len(k3.mla_layers)) == (93, 69, 24)
    hf = k3.to_hf_dict()
    assert hf["linear_attn_config"]["full_attn_layers"] == [*range(4, 93, 4), 93]
    assert hf["linear_attn_config"]["gate_lower_bound"] == -5.0 and hf["attn_res_block_size"] == 12
    assert (hf["activation_situ_beta"], hf["activation_situ_linear_beta"]) == (4.0, 25.0)
    assert (k3.num_experts, k3.num_experts_per_token, k3.num_shared_experts) == (896, 16, 2)
    assert abs(parameter_count(k3) / 2.78e12 - 1) < 0.01  # report: 2.8T total (close reading: 2.78T)
    shapes = parameter_shapes(k3)
    assert shapes["model.layers.1.block_sparse_moe.routed_expert_down_proj.weight"] == (3584, 7168)
    assert shapes["model.layers.0.self_attn.g_proj.weight"] == (96 * 128, 7168)


def test_nano_is_k3_in_miniature():
    nano = preset("nano")
    assert nano.mla_layers == (3, 7, 8) and nano.kda_layers == (0, 1, 2, 4, 5, 6)
    assert (
        nano.uses_attn_res
        and nano.uses_latent_moe
        and nano.hidden_act == "situ"
        and nano.num_shared_experts == 2
    )
    assert nano.num_hidden_layers % nano.attn_res_block_size != 0  # the last AttnRes block is incomplete
    assert 1e6 < parameter_count(nano) < 1e7
    assert 1e9 <= parameter_count(preset("mini")) <= 3e9
    kl = preset("nano-kl")
    assert (
        kl.gate_lower_bound is None
        and not kl.uses_attn_res
        and not kl.uses_latent_moe
        and kl.hidden_act == "silu"
    )


def _broken(**changes):
    raw = json.loads(json.dumps(KIMI_LINEAR_48B))
    for key, value in changes.items():
        if key.startswith("linear."):
            raw["linear_attn_config"][key[7:]] = value
        elif value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"linear.kda_layers": [1, 2, 3]}, "every layer"),
        ({"linear.full_attn_layers": [4, 8, 12, 16, 20, 24, 28]}, "outside 1..27"),
        ({"linear.kda_layers": "1-3"}, "list of 1-based"),
        ({"num_experts_per_token": 300}, "num_experts_per_token"),
        ({"model_type": "llama"}, "model_type"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"linear.gate_lower_bound": 1.0}, "gate_lower_bound"),
        ({"hidden_size": None}, "hidden_size"),
        ({"linear_attn_config": "kda"}, "linear_attn_config"),
    ],
)
def test_bad_configs_get_errors_naming_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        K3Config.from_hf_dict(_broken(**changes))


def test_bad_json_and_unknown_preset(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        K3Config.from_json_file(path)
    with pytest.raises(ConfigError, match="unknown preset 'k4'"):
        preset("k4")
