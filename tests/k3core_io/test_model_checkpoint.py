"""The real nano K3Model through the checkpoint code: names agree with the release, save -> load is
bit-exact, a loaded model computes what the saved one did."""

import pytest
import torch

from k3core.model import K3Model, parameter_shapes
from k3core.presets import preset
from k3core.weights import CheckpointMismatchError, load_checkpoint, load_into, save_checkpoint, shard_plan
from tests.k3core_io.nano_state import nano_state_dict


@pytest.mark.parametrize("name", ["nano", "nano-kl"])
def test_model_names_are_the_release_names(name):
    config = preset(name)
    model = K3Model(config)
    names = set(model.state_dict())
    assert names == set(parameter_shapes(config))
    if name == "nano":
        # An independent hand-written table of Kimi Linear + K3 names (tests/k3core_io/nano_state.py).
        hand = {n.replace("attn_res_attn.", "attn_res.attn.") for n in nano_state_dict(config)}
        # The hand table has one AttnRes site per layer; the model adds the pre-MLP and final sites.
        extra_sites = {f"model.layers.{i}.attn_res.mlp.{s}" for i in range(config.num_hidden_layers)
                       for s in ("query", "norm.weight")}  # fmt: skip
        assert names - hand == extra_sites | {"model.attn_res_final.query", "model.attn_res_final.norm.weight"}
        assert hand <= names
    shard_plan(config, 2)  # every tensor of the model has a TP rule


def test_whole_nano_model_save_load_bit_exact_and_same_logits(tmp_path):
    config = preset("nano")
    torch.manual_seed(0)
    model = K3Model(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # non-default values everywhere, so a skipped tensor would show
    save_checkpoint(tmp_path, model.state_dict(), config, max_shard_bytes=500_000)
    loaded = load_checkpoint(tmp_path, expected=parameter_shapes(config))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    torch.manual_seed(1)
    fresh = K3Model(config)
    assert load_into(fresh, tmp_path)["vocab_size"] == config.vocab_size
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    tokens = torch.tensor([config.bos_token_id, 104, 105, 0xE6, 0x97])
    with torch.no_grad():
        want = model.prefill(tokens, model.new_sequence_cache(), 0)
        got = fresh.prefill(tokens, fresh.new_sequence_cache(), 0)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    bad = K3Model(config.replace(hidden_size=config.hidden_size // 2))
    with pytest.raises(CheckpointMismatchError) as info:
        load_into(bad, tmp_path)
    v, d = config.vocab_size, config.hidden_size
    assert f"model.embed_tokens.weight: model wants [{v}, {d // 2}], checkpoint has [{v}, {d}]" in str(info.value)


def test_tied_embedding_model_round_trips(tmp_path):
    config = preset("nano").replace(tie_word_embeddings=True)
    model = K3Model(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_()
    save_checkpoint(tmp_path, model.state_dict(), config)
    assert set(load_checkpoint(tmp_path, expected=parameter_shapes(config)).state_dict) == set(parameter_shapes(config))
    fresh = K3Model(config)
    load_into(fresh, tmp_path)
    assert torch.equal(fresh.lm_head.weight, model.model.embed_tokens.weight)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()  # still tied
