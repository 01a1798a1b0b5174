"""services/runtime/metrics_scrape.py (which tests/support/metrics.py re-exports) against a real
prometheus_client registry served over a real HTTP socket on loopback, and the three production callers that
read /metrics through it (the rollout driver's served version, `k3 drill`'s failovers, `k3 status`'s table)."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from services.cli.drill_cmd import scrape_failovers
from services.cli.fleet_cmd import scrape as status_metrics
from services.trainer.rollout_backend import DecodeBackend
from tests.support.metrics import MetricSamples, MissingSample, ScrapeFailed, scrape

ODD_STAGE = 'odd "stage", with} chars\\ and\nlines'  # quoted, escaped and split on the wire


@contextmanager
def serve(registry: CollectorRegistry) -> Iterator[str]:
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    failovers = Counter("k3_gateway_failovers_total", "f", ["stage"], registry=registry)
    failovers.labels("mid_stream").inc(2)
    failovers.labels(ODD_STAGE).inc()
    requests = Counter("k3_test_requests_total", "r", ["stage", "cluster"], registry=registry)
    requests.labels("mid_stream", "c0").inc(4)
    requests.labels("mid_stream", "c1").inc(1)
    Gauge("k3_decode_weights_version", "v", registry=registry).set(3)
    Gauge("k3_decode_weights_version_pending", "a name sharing the prefix", registry=registry).set(7)
    in_flight = Gauge("k3_rpc_in_flight", "i", ["service"], registry=registry)
    in_flight.labels("decode").set(2)
    in_flight.labels("admin").set(0.5)
    latency = Histogram("k3_test_seconds", "s", buckets=(0.1, 1.0), registry=registry)
    for seconds in (0.05, 0.5, 5.0):
        latency.observe(seconds)
    return registry


@pytest.fixture
def address(registry) -> Iterator[str]:
    with serve(registry) as served:
        yield served


@pytest.fixture
def down_address() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_labelled_counters_gauges_and_histogram_series_by_full_name_and_exact_labels(address):
    samples = scrape(address)
    assert samples.value("k3_gateway_failovers_total", {"stage": "mid_stream"}) == 2
    assert samples.value("k3_gateway_failovers_total", {"stage": ODD_STAGE}) == 1
    assert samples.value("k3_test_requests_total", {"cluster": "c1", "stage": "mid_stream"}) == 1  # any order
    assert samples.value("k3_decode_weights_version") == 3
    assert samples.value("k3_decode_weights_version_pending") == 7
    # 0.05 <= 0.1 < 0.5 <= 1.0 < 5.0: cumulative buckets 1, 2, 3
    assert [samples.value("k3_test_seconds_bucket", {"le": le}) for le in ("0.1", "1.0", "+Inf")] == [1, 2, 3]
    assert samples.value("k3_test_seconds_count") == 3
    assert samples.value("k3_test_seconds_sum") == pytest.approx(0.05 + 0.5 + 5.0)
    assert samples.get("k3_test_seconds") is None  # a family name is not a sample
    assert samples.total("k3_test_requests_total") == 5 and samples.total("k3_test_missing") is None
    assert sorted(v for _, v in samples.series("k3_rpc_in_flight")) == [0.5, 2]


def test_a_label_subset_is_not_the_series_and_a_missing_sample_names_the_label_sets_there_are(address):
    samples = scrape(address)
    assert samples.get("k3_test_requests_total", {"stage": "mid_stream"}) is None
    assert samples.get("k3_test_requests_total", {"stage": "mid_stream"}, 0.0) == 0.0
    assert samples.get("k3_test_missing") is None
    with pytest.raises(MissingSample, match=r"label sets of k3_test_requests_total: .*'cluster': 'c0'"):
        samples.value("k3_test_requests_total", {"stage": "other", "cluster": "c0"})
    with pytest.raises(MissingSample, match=r"k3_test_missing\{\} not exported; label sets of k3_test_missing: \[\]"):
        samples.value("k3_test_missing")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=12), st.floats(min_value=0, max_value=1e12, allow_nan=False))
def test_any_label_value_round_trips_through_the_exposition_text(label_value, amount):
    registry = CollectorRegistry()
    Counter("k3_prop_total", "p", ["v"], registry=registry).labels(label_value).inc(amount)
    samples = MetricSamples.parse(generate_latest(registry).decode())
    assert samples.series("k3_prop_total") == [({"v": label_value}, amount)]


def test_a_down_endpoint_is_a_clean_error_naming_it(down_address):
    with pytest.raises(ScrapeFailed, match=f"cannot read metrics from http://{down_address}/metrics"):
        scrape(down_address, timeout=2)


def test_an_endpoint_that_never_answers_times_out():
    with socket.socket() as silent:  # the kernel completes the handshake; nobody reads or writes
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        with pytest.raises(ScrapeFailed, match="timed out"):
            scrape(f"127.0.0.1:{silent.getsockname()[1]}", timeout=0.3)
        assert time.monotonic() - started < 5  # bounded by the timeout, not the OS default


@pytest.mark.parametrize(("status", "body"), [(404, b"no metrics here"), (200, b"<html>a web page</html>\n")])
def test_an_error_status_or_a_body_that_is_not_prometheus_text_is_a_clean_error(status, body):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server hook's name)
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ScrapeFailed, match="cannot read metrics from"):
            scrape(f"127.0.0.1:{server.server_address[1]}", timeout=2)
    finally:
        server.shutdown()
        server.server_close()


async def test_the_rollout_driver_reads_the_unlabelled_version_not_a_prefix_sharing_name(address, down_address):
    backends = [DecodeBackend("127.0.0.1:1", metrics) for metrics in (address, down_address)]
    try:
        assert backends[0].served_version() == 3
        with pytest.raises(OSError, match="cannot read metrics"):  # what wait_version lets through
            backends[1].served_version()
        with serve(CollectorRegistry()) as empty_address:  # no swap yet: the initial weights, version 0
            backends[1].metrics_address = empty_address
            assert backends[1].served_version() == 0
    finally:
        for backend in backends:
            await backend.close()


def test_drill_reads_failovers_by_stage_even_with_commas_and_quotes_in_a_stage(address, down_address):
    assert scrape_failovers(address) == {"mid_stream": 2, ODD_STAGE: 1}
    assert scrape_failovers(down_address) is None and scrape_failovers("") is None


def test_status_sums_key_metrics_over_label_sets(address, down_address):
    assert status_metrics(address) == "rpc_in_flight=2.5 gateway_failovers_total=3"
    assert status_metrics(down_address) == "metrics unreachable" and status_metrics("") == ""
