"""A policy step on the nano model moves probability towards the rewarded sample."""

from __future__ import annotations

import torch

from k3core.model.init import init_weights
from k3core.model.k3model import K3Model
from k3core.presets import preset
from services.trainer.learner import Learner, Sample


def test_step_raises_logprob_of_rewarded_sample_and_updates_router_bias():
    torch.manual_seed(0)
    model = init_weights(K3Model(preset("nano")), seed=0)
    learner = Learner(model, lr=5e-3, adam_lr=1e-3)
    prompt = [1, 2, 3, 4]
    good, bad = prompt + [10, 11, 12, 13], prompt + [20, 21, 22, 23]
    mask = [0] * len(prompt) + [1] * 4

    def samples():
        with torch.no_grad():
            lp = [x.tolist() for x in learner.token_logprobs(
                [Sample("g", good, [0.0] * 8, mask, 1.0), Sample("g", bad, [0.0] * 8, mask, 0.0)])]
        return [Sample("g", good, [0.0] + lp[0], mask, 1.0), Sample("g", bad, [0.0] + lp[1], mask, 0.0)]

    def seq_logp(tokens):
        with torch.no_grad():
            return learner.token_logprobs([Sample("g", tokens, [0.0] * 8, mask, 0.0)])[0][len(prompt) - 1:].sum()

    before_good, before_bad = seq_logp(good), seq_logp(bad)
    biases = [g.e_score_correction_bias.clone() for g in learner.gates]
    for _ in range(2):
        stats = learner.step(samples())
        assert stats.tokens == 8 and stats.max_log_ratio < 1e-4  # on-policy: behaviour == current
    assert seq_logp(good) > before_good + 0.1
    assert seq_logp(bad) < before_bad
    assert learner.gates and any(not torch.equal(b, g.e_score_correction_bias) for b, g in zip(biases, learner.gates, strict=True))


def test_per_head_muon_uses_each_layers_own_head_count():
    # KDA and MLA head counts differ here; MLA's q_proj rows are 2 heads x (nope + rope), not 4 blocks.
    model = K3Model(preset("nano-kl").replace(num_attention_heads=2))
    learner = Learner(model)
    heads_of = {id(p): g["heads"] for g in learner.muon.param_groups for p in g["params"]}
    layers = model.model.layers
    assert [heads_of[id(layers[i].self_attn.q_proj.weight)] for i in (0, 3)] == [4, 2]  # KDA, MLA
    assert heads_of[id(layers[0].self_attn.k_proj.weight)] == 4
    assert heads_of[id(layers[3].self_attn.kv_b_proj.weight)] == 0
