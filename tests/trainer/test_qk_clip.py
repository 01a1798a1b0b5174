"""QK-Clip fed by the forward: after a large policy step every Gated MLA head's max logit on the step's
batch is <= tau, and heads under tau keep their weights bit for bit (oracle: float64 logits, head by head,
from each layer's captured input)."""

from __future__ import annotations

import copy

import torch

from k3core.layers.mla import GatedMLA
from k3core.model.init import init_weights
from k3core.model.k3model import K3Model
from k3core.presets import preset
from services.trainer.learner import Learner, Sample
from services.trainer.qk_clip import query_weight


def samples() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(2):
        tokens = torch.randint(3, 250, (12,), generator=g).tolist()
        out.append(Sample("g", tokens, [0.0] * 12, [0] * 3 + [1] * 9, float(i)))
    return out


def max_logits_oracle(learner: Learner, batch: list[Sample]) -> dict[int, list[float]]:
    """Per-head max over causal (i >= j) pairs of (q_i . k_j) / sqrt(d), in float64, each sequence alone."""
    inputs: dict[int, torch.Tensor] = {}
    layers = [m for m in learner.model.modules() if isinstance(m, GatedMLA)]
    hooks = [m.register_forward_pre_hook(lambda m, a: inputs.__setitem__(m.mla_index, a[0].detach()))
             for m in layers]
    with torch.no_grad():
        learner._logits(batch)
    for h in hooks:
        h.remove()
    out = {}
    for layer in layers:
        x = inputs[layer.mla_index].double()
        w_q = query_weight(layer).double()
        q_in = layer.q_a_layernorm(layer.q_a_proj(x.float())).double() if layer.q_lora else x
        q = (q_in @ w_q.T).view(len(x), layer.heads, -1)
        latent = layer.latent(x.float()).double()
        kv = (latent[:, : layer.rank] @ layer.kv_b_proj.weight.double().T).view(len(x), layer.heads, -1)
        k = torch.cat([kv[..., : layer.nope], latent[:, None, layer.rank :].expand(-1, layer.heads, -1)], -1)
        best = [-float("inf")] * layer.heads
        start = 0
        for s in batch:
            end = start + len(s.tokens)
            for h in range(layer.heads):
                scores = q[start:end, h] @ k[start:end, h].T / (layer.nope + layer.rope) ** 0.5
                causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
                best[h] = max(best[h], scores[causal].max().item())
            start = end
        out[layer.mla_index] = best
    return out


def test_qk_clip_caps_mla_logits_after_a_large_step_and_leaves_other_heads():
    batch = samples()
    model = init_weights(K3Model(preset("nano")), seed=0)
    before = max_logits_oracle(Learner(model, qk_clip_tau=None), batch)
    free = Learner(copy.deepcopy(model), lr=0.05, qk_clip_tau=None)
    free.step(batch)
    unclipped = max_logits_oracle(free, batch)
    flat = sorted(v for heads in unclipped.values() for v in heads)
    tau = (flat[len(flat) // 2 - 1] + flat[len(flat) // 2]) / 2  # half of the heads over it, half under
    # the large step is what drives some heads past tau
    assert any(b < tau < a for layer in before for b, a in zip(before[layer], unclipped[layer], strict=True))

    clipped = Learner(copy.deepcopy(model), lr=0.05, qk_clip_tau=tau)
    stats = clipped.step(batch)
    after = max_logits_oracle(clipped, batch)
    assert stats.clipped_heads >= len(flat) // 2 and stats.max_attention_logit > tau
    for layer in after:
        assert max(after[layer]) <= tau * (1 + 1e-5), (layer, after[layer], tau)
    first = min(unclipped)  # the first MLA layer's input is the same in both runs: clipped heads sit at tau
    for h, value in enumerate(unclipped[first]):
        if value > tau:
            assert abs(after[first][h] - tau) < 1e-4 * tau

    free_layers = {m.mla_index: m for m in free.model.modules() if isinstance(m, GatedMLA)}
    for layer in (m for m in clipped.model.modules() if isinstance(m, GatedMLA)):
        twin = free_layers[layer.mla_index]
        per_head_q = query_weight(layer).view(layer.heads, -1), query_weight(twin).view(layer.heads, -1)
        per_head_kv = layer.kv_b_proj.weight.view(layer.heads, -1), twin.kv_b_proj.weight.view(layer.heads, -1)
        for h in range(layer.heads):
            untouched = torch.equal(per_head_q[0][h], per_head_q[1][h]) and torch.equal(per_head_kv[0][h], per_head_kv[1][h])
            # measured under tau (by the clip, before its layer ran) <=> bit-identical to the unclipped step
            under = unclipped[layer.mla_index][h] < tau * (1 - 1e-3)
            if under:
                assert untouched, (layer.mla_index, h)
            elif unclipped[layer.mla_index][h] > tau * (1 + 1e-3) and layer.mla_index == first:
                assert not untouched
