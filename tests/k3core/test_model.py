"""K3Model on the nano presets: caches, resumption and batching against one full-sequence forward."""

import random

import pytest
import torch

from k3core.cache.contiguous import ContiguousBatchCache
from k3core.model import K3Model, parameter_shapes
from k3core.model.init import init_weights
from k3core.ops.qb import expert_loads, qb_update_histogram
from k3core.presets import preset

# float32 is held to 1e-4 of the largest logit (random nano weights amplify rounding through the RMSNorm of
# near-zero KDA outputs, measured ~3e-5); float64 shows the paths agree exactly (measured ~1e-13).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}


@pytest.fixture(
    scope="module",
    params=[("nano", torch.float32), ("nano-kl", torch.float32), ("nano", torch.float64)],
    ids=["nano-fp32", "nano-kl-fp32", "nano-fp64"],
)
def model(request):
    name, dtype = request.param
    return init_weights(K3Model(preset(name)), seed=0).to(dtype).eval()


def _close(a, b, model):
    return float((a - b).abs().max() / b.abs().max()) < TOLERANCE[model.lm_head.weight.dtype]


def _cache(model):
    return model.new_sequence_cache(
        state_dtype=torch.promote_types(model.lm_head.weight.dtype, torch.float32)
    )


def _tokens(n, seed):
    return torch.randint(0, 263, (n,), generator=torch.Generator().manual_seed(seed))


def test_module_tree_matches_the_checkpoint_name_table(model):
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes == parameter_shapes(model.config)


def test_tied_embeddings_share_one_tensor():
    tied = K3Model(preset("nano").replace(tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert "lm_head.weight" not in parameter_shapes(tied.config)


def test_step_by_step_decode_equals_full_forward(model):
    tokens = _tokens(24, 1)
    full = model.prefill(tokens, _cache(model), 0)
    cache = _cache(model)
    steps = torch.cat([model.decode(tokens[t : t + 1], [cache]) for t in range(24)])
    assert _close(steps, full, model)
    assert cache.length == 24


def test_prefill_split_at_random_points_resumes_exactly(model):
    tokens = _tokens(70, 2)  # > one 64-token chunk
    whole_cache = _cache(model)
    whole = model.prefill(tokens, whole_cache, 0)
    rng = random.Random(3)
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, 70), 3))
        cache, parts = _cache(model), []
        for start, end in zip([0, *cuts], [*cuts, 70], strict=True):
            parts.append(model.prefill(tokens[start:end], cache, start))
        assert _close(torch.cat(parts), whole, model)
        assert _close(cache.kda_state, whole_cache.kda_state, model)
        for layer in range(len(model.config.mla_layers)):
            assert _close(cache.mla_rows(layer, 70), whole_cache.mla_rows(layer, 70), model)


def test_batched_varlen_forward_and_decode_equal_each_sequence_alone(model):
    prompts = [_tokens(n, 10 + n) for n in (5, 17, 1)]
    alone = []
    for p in prompts:
        cache = _cache(model)
        logits = [model.prefill(p, cache, 0)[-1:]]
        nxt = [int(p[0]), int(p[-1])]
        for t in nxt:
            logits.append(model.decode(torch.tensor([t]), [cache]))
        alone.append(torch.cat(logits))
    caches = [_cache(model) for _ in prompts]
    batch = ContiguousBatchCache(caches, [len(p) for p in prompts])
    with torch.no_grad():
        packed = model(torch.cat(prompts), batch, logits_for="last")  # one varlen prefill of all three
    batch.commit()
    together = [packed]
    for step in range(2):
        toks = torch.tensor([int(p[0]) if step == 0 else int(p[-1]) for p in prompts])
        together.append(model.decode(toks, caches))
    together = torch.stack(together, dim=1)  # [B, 3, V]
    for b in range(3):
        assert _close(together[b], alone[b], model)


def test_attn_res_two_phase_equals_direct():
    config = preset("nano")
    fast = init_weights(K3Model(config, attn_res_two_phase=True), seed=5)
    direct = K3Model(config, attn_res_two_phase=False)
    direct.load_state_dict(fast.state_dict())
    tokens = _tokens(12, 4)
    a = fast.prefill(tokens, fast.new_sequence_cache(), 0)
    b = direct.prefill(tokens, direct.new_sequence_cache(), 0)
    assert _close(a, b, fast)


def test_bad_calls_are_rejected_and_leave_the_cache_untouched(model):
    cache = _cache(model)
    model.prefill(_tokens(4, 0), cache, 0)
    before = cache.clone()
    with pytest.raises(ValueError, match="start=2"):
        model.prefill(_tokens(3, 0), cache, 2)
    with pytest.raises(ValueError, match="token ids"):
        model.prefill(torch.tensor([1, 99999]), cache, 4)
    with pytest.raises(ValueError, match="one token per sequence"):
        model.decode(torch.tensor([1, 2]), ContiguousBatchCache([cache], [2]))
    assert cache.length == 4 and torch.equal(cache.kda_state, before.kda_state)
    assert torch.equal(cache.mla_rows(0, 4), before.mla_rows(0, 4))


def test_qb_bias_updates_balance_the_routers_of_a_real_forward():
    """What the trainer does each step: read each MoE layer's scores, move its bias by QB (eq.14)."""
    model = init_weights(K3Model(preset("nano")), seed=1).eval()
    tokens = _tokens(256, 9)
    moe_layers = [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]
    captured = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: captured.__setitem__(mod, args[0])) for m in moe_layers
    ]

    def imbalance():
        captured.clear()
        model.prefill(tokens, model.new_sequence_cache(), 0)
        worst = 0.0
        for moe in moe_layers:
            _, _, scores = moe.route(captured[moe])
            loads = expert_loads(scores, moe.gate.e_score_correction_bias, moe.top_k).float()
            worst = max(worst, float(loads.max() / loads.mean()))
        return worst

    before = after = imbalance()
    for _ in range(3):  # each update uses the scores of the forward just run under the current biases
        with torch.no_grad():
            for moe in moe_layers:
                _, _, scores = moe.route(captured[moe])
                bias = moe.gate.e_score_correction_bias
                bias.copy_(qb_update_histogram(scores, bias, moe.top_k))
        after = imbalance()
    for hook in hooks:
        hook.remove()
    assert before > 2.0 and after <= 1.3  # measured 2.22 -> 1.27 (256 tokens: 64 per expert, sampling noise)
