"""Tensor-parallel plan: every tensor covered, heads split, latent replicated, experts owned;
shard -> merge is the identity; a rank reads exactly its slice from disk (MXFP4 included)."""

import pytest
import torch

from k3core.weights import (
    MxQuantConfig,
    ShardPlanError,
    load_checkpoint,
    merge_shards,
    save_checkpoint,
    shard_plan,
    shard_state_dict,
)
from k3core.weights.sharding import EXPERT, REPLICATE, SPLIT
from tests.k3core_io.nano_state import nano_state_dict, small_config

CONFIG = small_config()
STATE = nano_state_dict(CONFIG)
SHAPES = {n: tuple(t.shape) for n, t in STATE.items()}


def plan_for(tp, shapes=SHAPES):
    return shard_plan(CONFIG, tp, shapes=shapes)


def test_layouts_follow_the_head_latent_and_expert_rules():
    plan = plan_for(2)
    kda, mla, moe = "model.layers.0.self_attn.", "model.layers.3.self_attn.", "model.layers.1.block_sparse_moe."
    for name in ("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_proj", "q_conv1d"):
        assert plan[kda + name + ".weight"] == plan[kda + "dt_bias"] == type(plan[kda + "dt_bias"])(SPLIT, 2, dim=0)
    assert plan[kda + "A_log"].dim == 2  # [1, 1, heads, 1]
    assert plan[kda + "o_proj.weight"].dim == 1
    assert plan[kda + "f_a_proj.weight"].kind == plan[kda + "o_norm.weight"].kind == REPLICATE
    for name in ("kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_proj", "q_a_layernorm"):
        assert plan[mla + name + ".weight"].kind == REPLICATE  # the cached latent is whole on every rank
    assert plan[mla + "kv_b_proj.weight"].dim == 0 and plan[mla + "q_b_proj.weight"].dim == 0
    assert plan[mla + "o_proj.weight"].dim == 1
    owners = [plan[moe + f"experts.{e}.w1.weight"].owner for e in range(CONFIG.num_experts)]
    assert owners == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {plan[moe + f"experts.{e}.w2.weight"].kind for e in range(8)} == {EXPERT}
    assert plan[moe + "gate.weight"].kind == plan[moe + "routed_expert_up_proj.weight"].kind == REPLICATE
    assert plan[moe + "shared_experts.up_proj.weight"].dim == 0 and plan[moe + "shared_experts.down_proj.weight"].dim == 1
    # 263 byte-level tokens do not split in two: the vocabulary stays whole rather than failing.
    assert plan["model.embed_tokens.weight"].kind == REPLICATE


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_then_merge_is_the_original(tp):
    plan = plan_for(tp)
    shards = [shard_state_dict(STATE, plan, r) for r in range(tp)]
    if tp == 2:
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(torch.cat([shards[0][q], shards[1][q]]), STATE[q])
        assert "model.layers.1.block_sparse_moe.experts.5.w1.weight" not in shards[0]
        per_rank = [sum(t.numel() for t in s.values()) for s in shards]
        assert per_rank[0] == per_rank[1] < sum(t.numel() for t in STATE.values())
    merged = merge_shards(shards, plan)
    assert merged.keys() == STATE.keys() and all(torch.equal(merged[n], STATE[n]) for n in STATE)


def test_plan_errors_list_every_problem():
    shapes = {**SHAPES, "model.layers.0.self_attn.mystery.weight": (4, 4)}
    with pytest.raises(ShardPlanError) as info:
        plan_for(4, shapes)
    message = str(info.value)
    assert "mystery.weight: no sharding rule" in message
    # Element counts divide by 4 but 2 heads do not: refused rather than cutting through a head.
    assert "config.kda_num_heads=2 does not divide over 4 ranks" in message
    assert "config.num_attention_heads=2 does not divide over 4 ranks" in message
    assert "model.layers.0.self_attn.b_proj.weight: shape [2, 64] does not split over 4 ranks on dim 0" in message
    with pytest.raises(ShardPlanError, match="8 experts do not divide over 3 ranks"):
        plan_for(3)
    with pytest.raises(ShardPlanError, match="not in plan"):
        shard_state_dict({**STATE, "extra": torch.zeros(1)}, plan_for(2), 0)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_rank_loads_exactly_its_shard(tmp_path, quantized):
    quant = MxQuantConfig() if quantized else None
    save_checkpoint(tmp_path, STATE, CONFIG, quantization=quant, max_shard_bytes=300_000)
    plan = plan_for(2)
    full = load_checkpoint(tmp_path, expected=SHAPES, dtype=torch.float32).state_dict
    for rank in range(2):
        part = load_checkpoint(tmp_path, expected=SHAPES, plan=plan, rank=rank, dtype=torch.float32).state_dict
        want = shard_state_dict(full, plan, rank)
        assert part.keys() == want.keys() and all(torch.equal(part[n], want[n]) for n in want)
    if quantized:  # packed experts split by owner and stay packed on request
        kept = load_checkpoint(tmp_path, plan=plan, rank=1, dequantize=False).state_dict
        assert "model.layers.1.block_sparse_moe.experts.7.w3.weight_packed" in kept
        assert "model.layers.1.block_sparse_moe.experts.0.w3.weight_packed" not in kept
