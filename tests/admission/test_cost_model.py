"""The cost model against hand-computed values, and its calibration fit against a known model."""

from __future__ import annotations

import pytest

from services.admission.classifier import RequestClassifier
from services.admission.cost_model import CostModel

TOY = CostModel(prefill_ms_per_token=1.0, attention_ms_per_token_pair=0.01, decode_ms_per_step=2.0,
                decode_ms_per_context_token=0.001)


def test_prefill_and_decode_match_hand_computation():
    # 10 uncached tokens after 100 cached: 10 * (1 + 0.01 * (100 + 5)) = 20.5
    assert TOY.prefill(110, 100) == pytest.approx(20.5)
    # Nothing to prefill when the whole prompt is cached.
    assert TOY.prefill(64, 64) == 0.0
    # 4 output tokens after a 1000-token prompt: 4 * (2 + 0.001 * (1000 + 2)) = 12.008
    assert TOY.decode(1000, 4) == pytest.approx(12.008)
    assert TOY.cost(110, 100, 4) == pytest.approx(20.5 + 4 * (2 + 0.001 * 112))


def test_k3_calibration_spans_three_orders_of_magnitude():
    k3 = CostModel.k3_h200()
    short, long = k3.cost(2_048, 0, 256), k3.cost(1_000_000, 0, 1_024)
    assert 1_000 <= long / short <= 10_000
    # A cached 400K prefix with a 4K delta (the report's example) costs ~50x less than re-prefilling it.
    assert k3.cost(400_000, 396_000, 1_024) < 0.05 * k3.cost(400_000, 0, 1_024)


def test_fit_recovers_known_constants():
    samples = [(p, c, TOY.prefill(p, c)) for p, c in [(512, 0), (4096, 0), (8192, 4096), (65536, 1024)]]
    fitted = CostModel.k3_h200().fit_prefill(samples)
    assert fitted.prefill_ms_per_token == pytest.approx(1.0, rel=1e-6)
    assert fitted.attention_ms_per_token_pair == pytest.approx(0.01, rel=1e-6)


def test_fit_rejects_too_few_or_nonphysical_samples():
    with pytest.raises(ValueError, match="samples"):
        TOY.fit_prefill([(100, 0, 1.0)])
    with pytest.raises(ValueError, match="non-physical"):
        TOY.fit_prefill([(100, 0, -5.0), (200, 0, -10.0)])


def test_classes_follow_cost_bands_failover_and_overrides():
    classifier = RequestClassifier(TOY, short_max_cost=100, medium_max_cost=10_000)
    assert classifier.classify(50, 0, 1).request_class == "SHORT"
    assert classifier.classify(500, 0, 1).request_class == "MEDIUM"
    assert classifier.classify(5_000, 0, 1).request_class == "LONG"
    # Caching most of a long prompt makes it cheap again.
    assert classifier.classify(5_000, 4_999, 1).request_class == "SHORT"
    assert classifier.classify(50, 0, 1, failover=True).request_class == "FAILOVER"
    assert classifier.classify(50, 0, 1, override="ROLLOUT").request_class == "ROLLOUT"
    # ceil(50 * (1 + 0.01 * 25)) prefill + ceil(2 + 0.001 * 50.5) decode
    assert (classifier.classify(50, 0, 1).cost, classifier.classify(50, 0, 1).prefill_cost) == (66, 63)


@pytest.mark.parametrize("args, field", [((0, 0, 1), "prompt_tokens"), ((10, 11, 1), "cached_tokens")])
def test_bad_token_counts_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        RequestClassifier(TOY, 100, 10_000).classify(*args)


def test_unknown_class_override_is_rejected():
    with pytest.raises(ValueError, match="request_class"):
        RequestClassifier(TOY, 100, 10_000).classify(10, 0, 1, override="BULK")
