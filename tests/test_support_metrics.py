"""tests/support/metrics.py against a real prometheus_client registry's exposition text."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tests.support.metrics import MetricSamples


@pytest.fixture
def samples() -> MetricSamples:
    registry = CollectorRegistry()
    failovers = Counter("k3_test_failovers_total", "f", ["stage", "cluster"], registry=registry)
    failovers.labels("mid_stream", "c0").inc(2)
    failovers.labels('odd "stage", with} chars', "c1").inc()
    Gauge("k3_test_usage", "u", registry=registry).set(0.25)
    latency = Histogram("k3_test_seconds", "s", buckets=(0.1, 1.0), registry=registry)
    for seconds in (0.05, 0.5, 5.0):
        latency.observe(seconds)
    return MetricSamples.parse(generate_latest(registry).decode())


def test_counters_gauges_and_histogram_series_by_name_and_labels(samples):
    assert samples.value("k3_test_failovers_total", {"stage": "mid_stream", "cluster": "c0"}) == 2
    odd = {"cluster": "c1", "stage": 'odd "stage", with} chars'}  # quoted, escaped on the wire
    assert samples.value("k3_test_failovers_total", odd) == 1
    assert samples.value("k3_test_usage") == 0.25
    assert samples.value("k3_test_seconds_count") == 3
    assert samples.value("k3_test_seconds_sum") == pytest.approx(5.55)
    assert [samples.value("k3_test_seconds_bucket", {"le": le}) for le in ("0.1", "1.0", "+Inf")] == [1, 2, 3]


def test_labels_match_exactly_and_absent_series_are_reported(samples):
    assert samples.get("k3_test_failovers_total", {"stage": "mid_stream"}) is None  # a subset: not the series
    assert samples.get("k3_test_failovers_total", {"stage": "mid_stream"}, 0.0) == 0.0
    assert samples.get("k3_test_missing") is None
    with pytest.raises(AssertionError, match="label sets of k3_test_failovers_total: .*'mid_stream'"):
        samples.value("k3_test_failovers_total", {"stage": "other", "cluster": "c0"})
