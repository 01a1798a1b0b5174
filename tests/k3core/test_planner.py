"""Planner numbers against the close reading's hand arithmetic (seeds/003) and first principles."""

import json

import pytest

from k3core.model.parameters import parameter_count
from k3core.planner import GIB, MIB, cache_plan, main, weight_bytes_per_rank
from k3core.presets import preset


def test_k3_reproduces_the_close_reading():
    plan = cache_plan(preset("k3"), tp=1, state_dtype="bf16", latent_values=512, include_conv=False)
    assert plan.kda_state_bytes == 207 * MIB  # 96 heads x 128 x 128 x 2 B = 3 MiB per layer, 69 layers
    assert plan.mla_token_bytes == 24 * 1024  # 512 values x 2 B x 24 layers
    assert round(plan.crossover_vs_all_mla) == 3072  # hybrid = 93-layer all-MLA
    assert abs(plan.state_equals_kv_at - 8800) < 50  # "about 8,800": exactly 8,832
    assert (
        round(plan.sequence_bytes(1000) / MIB) == 230 and round(1000 * plan.all_mla_token_bytes / MIB) == 91
    )
    million = 2**20
    assert round(plan.sequence_bytes(million) / GIB, 1) == 24.2
    assert abs(million * plan.all_mla_token_bytes / GIB - 92.9) < 0.2
    assert round(1 - plan.sequence_bytes(million) / (million * plan.all_mla_token_bytes), 2) == 0.74


def test_what_the_cache_really_stores_and_tensor_parallel_split():
    k3 = preset("k3")
    full = cache_plan(k3)  # 576-value latent (c_kv + k_pe) and the short-conv tails
    assert full.mla_token_bytes == 576 * 2 * 24
    assert full.kda_state_bytes == 69 * (96 * 128 * 128 * 2 + 3 * 96 * 128 * 3 * 2)
    tp8 = cache_plan(k3, tp=8)
    assert tp8.kda_state_bytes * 8 == full.kda_state_bytes and tp8.mla_token_bytes == full.mla_token_bytes
    with pytest.raises(ValueError, match="tp=5"):
        cache_plan(k3, tp=5)


def test_weight_bytes():
    nano = preset("nano")
    assert weight_bytes_per_rank(nano, 1, expert_dtype="bf16") == 2 * parameter_count(nano)
    one, two = weight_bytes_per_rank(nano, 1), weight_bytes_per_rank(nano, 2)
    assert one / 2 < two < one
    k3_bytes = weight_bytes_per_rank(preset("k3"), 1)
    assert 1.4e12 < k3_bytes < 1.7e12  # ~2.72T expert params at 4.25 bits + ~60B bf16 params


def test_cli_table_json_and_errors(capsys, tmp_path):
    assert main(["--preset", "k3", "--tp", "8", "--ep", "16"]) == 0
    out = capsys.readouterr().out
    assert "KDA state per sequence" in out and "3,072 / 8,832 tokens" in out
    assert main(["--preset", "nano", "--json", "--context", "1000"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sequences_that_fit"] > 0 and result["mla_bytes_per_token"] == 3 * 80 * 2
    path = tmp_path / "config.json"
    path.write_text("{}")
    assert main(["--config", str(path)]) == 2
    assert "linear_attn_config is required" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--tp", "0"])
