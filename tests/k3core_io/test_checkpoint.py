"""Hugging Face layout save/load: bit-exact, strict errors listing every problem, MXFP4 experts."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3core.config import K3Config
from k3core.quant import mxfp4
from k3core.weights import (
    K3_IGNORE,
    CheckpointError,
    CheckpointMismatchError,
    MxQuantConfig,
    load_checkpoint,
    save_checkpoint,
)
from tests.k3core_io.nano_state import nano_state_dict, small_config

CONFIG = small_config()


@pytest.fixture(scope="module")
def state():
    sd = nano_state_dict(CONFIG)
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.bfloat16)  # mixed dtypes survive
    return sd


def shapes(sd):
    return {n: tuple(t.shape) for n, t in sd.items()}


def test_save_load_is_bit_exact_across_many_shards(tmp_path, state):
    save_checkpoint(tmp_path, state, CONFIG, max_shard_bytes=200_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    loaded = load_checkpoint(tmp_path, expected=shapes(state))
    assert list(loaded.state_dict) == list(state)
    for name, tensor in state.items():
        got = loaded.state_dict[name]
        assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
    assert K3Config.from_hf_dict(loaded.config) == CONFIG
    assert loaded.quantization is None


def test_single_file_checkpoint_and_tied_storage(tmp_path):
    emb = torch.randn(4, 8)
    # A tied lm_head is written once (Hugging Face convention; config.json records the tie).
    save_checkpoint(tmp_path / "a", {"model.embed_tokens.weight": emb, "lm_head.weight": emb}, {"x": 1})
    loaded = load_checkpoint(tmp_path / "a")
    assert list(loaded.state_dict) == ["model.embed_tokens.weight"] and loaded.config == {"x": 1}
    assert torch.equal(loaded.state_dict["model.embed_tokens.weight"], emb)
    (tmp_path / "b").mkdir()
    save_file({"w": emb}, tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.json").write_text("{}")
    assert torch.equal(load_checkpoint(tmp_path / "b").state_dict["w"], emb)


def test_one_error_names_every_missing_unexpected_and_misshaped_tensor(tmp_path, state):
    broken = dict(state)
    del broken["model.layers.0.self_attn.q_proj.weight"]
    del broken["model.layers.3.self_attn.kv_b_proj.weight"]
    broken["model.layers.1.self_attn.surprise.weight"] = torch.zeros(2)
    broken["model.layers.2.self_attn.dt_bias"] = torch.zeros(7)
    save_checkpoint(tmp_path, broken, CONFIG)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(tmp_path, expected=shapes(state))
    err = info.value
    assert err.missing == ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.kv_b_proj.weight"]
    assert err.unexpected == ["model.layers.1.self_attn.surprise.weight"]
    assert err.mismatched == [("model.layers.2.self_attn.dt_bias", (32,), (7,))]
    for name in ("q_proj", "kv_b_proj", "surprise", "dt_bias", "[32]", "[7]"):
        assert name in str(err)
    # A deliberately unused part (say an MTP head) is skipped by pattern, not read, not reported.
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(tmp_path, expected=shapes(state), skip=[r".*\.surprise\."])
    assert info.value.unexpected == [] and len(info.value.missing) == 2


def test_index_that_disagrees_with_its_shards_is_refused(tmp_path, state):
    save_checkpoint(tmp_path, state, CONFIG, max_shard_bytes=400_000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = index["weight_map"]["model.embed_tokens.weight"]
    assert index["weight_map"]["model.norm.weight"] != first
    index["weight_map"]["model.norm.weight"] = first
    index["weight_map"]["ghost"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    assert "model-00009-of-00009.safetensors: listed in the index but missing" in str(info.value)
    assert f"{first}: lacks model.norm.weight which the index puts there" in str(info.value)
    assert "holds model.norm.weight which the index does not list there" in str(info.value)
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_checkpoint(tmp_path / "nowhere")


def test_mxfp4_experts_only_and_exact_dequantisation(tmp_path, state):
    quant = MxQuantConfig()
    save_checkpoint(tmp_path, state, CONFIG, quantization=quant, max_shard_bytes=300_000)
    config = json.loads((tmp_path / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert qc["ignore"] == list(K3_IGNORE)
    stored = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    packed = sorted(n for n in stored if n.endswith(".weight_packed"))
    experts = sorted(n[: -len(".weight")] + ".weight_packed" for n in state if ".experts." in n)
    assert packed == experts  # shared experts, router, latent projections, attention stay full precision
    name = "model.layers.1.block_sparse_moe.experts.3.w2"
    with safe_open(tmp_path / stored[name + ".weight_packed"], "pt") as f:
        assert f.get_tensor(name + ".weight_packed").dtype == torch.uint8
    loaded = load_checkpoint(tmp_path, expected=shapes(state), dtype=torch.float32)
    want = mxfp4.dequantize(*mxfp4.quantize(state[name + ".weight"]), torch.float32)
    assert torch.equal(loaded.state_dict[name + ".weight"], want)
    for other in ("model.layers.1.block_sparse_moe.shared_experts.up_proj.weight", "model.layers.0.self_attn.g_proj.weight"):
        assert torch.equal(loaded.state_dict[other], state[other])
    kept = load_checkpoint(tmp_path, expected=shapes(state), dequantize=False).state_dict
    assert kept[name + ".weight_packed"].shape == (32, 16) and kept[name + ".weight_scale"].shape == (32, 1)
    assert name + ".weight" not in kept
    assert loaded.quantization == quant


def test_broken_mxfp4_checkpoints_are_refused(tmp_path, state):
    quant = MxQuantConfig()
    save_checkpoint(tmp_path, state, CONFIG, quantization=quant)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="group_size 32"):
        load_checkpoint(tmp_path)
    config["quantization_config"]["format"] = "nvfp4-pack-quantized"
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="only 'mxfp4-pack-quantized' is supported"):
        load_checkpoint(tmp_path)
    del config["quantization_config"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_checkpoint(tmp_path)
    bad = {"a.weight_packed": torch.zeros(4, 16, dtype=torch.uint8), "a.weight_scale": torch.zeros(4, 2, dtype=torch.uint8),
           "b.weight_scale": torch.zeros(1, 1, dtype=torch.uint8)}  # fmt: skip
    save_checkpoint(tmp_path / "bad", bad, {}, quantization=quant)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "bad")
    assert "a.weight_scale: shape [4, 2] does not fit packed [4, 16]" in str(info.value)
    assert "b.weight_scale without its .weight_packed" in str(info.value)


def test_quantization_config_round_trips_with_format_at_group_level():
    raw = MxQuantConfig().to_hf_dict()
    raw["config_groups"]["group_0"]["format"] = raw.pop("format")  # newer compressed-tensors layout
    assert MxQuantConfig.from_hf_dict(raw) == MxQuantConfig()
    assert MxQuantConfig().quantizes("model.layers.1.block_sparse_moe.experts.0.w1")
    assert not MxQuantConfig().quantizes("model.layers.1.block_sparse_moe.shared_experts.up_proj")
    # The release's class target "Linear" plus its ignore list: router and attention stay unquantised.
    released = MxQuantConfig(targets=("Linear",))
    assert released.quantizes("model.layers.1.block_sparse_moe.experts.0.w2")
    assert not released.quantizes("model.layers.1.block_sparse_moe.gate")
    assert not released.quantizes("model.layers.0.self_attn.q_proj")


def test_tied_head_is_not_stored_even_when_cloned(tmp_path):
    emb = torch.randn(4, 8)
    config = {"tie_word_embeddings": True}
    save_checkpoint(tmp_path, {"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone()}, config)
    assert list(load_checkpoint(tmp_path).state_dict) == ["model.embed_tokens.weight"]
    with pytest.raises(CheckpointError, match="ties lm_head"):
        save_checkpoint(tmp_path, {"model.embed_tokens.weight": emb, "lm_head.weight": emb + 1}, config)
