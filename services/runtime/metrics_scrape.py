"""Read a service's Prometheus /metrics: fetch the text, parse it with prometheus_client's own exposition
parser, look samples up by full sample name and exact label set.

Full sample names: a counter's `_total`, a histogram's `_bucket` / `_sum` / `_count`, so names that share a
prefix never mix. Exact label sets: `{"stage": "mid_stream"}` never matches a series with more labels, and
label order, quoting and escaping on the wire do not matter.
"""

from __future__ import annotations

import http.client
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, frozenset[tuple[str, str]]]


class ScrapeFailed(OSError):
    """The endpoint is down, timed out, answered an error, or its body is not Prometheus text. An OSError, so
    callers treating "cannot read metrics" like any other I/O failure need no new except clause."""


class MissingSample(LookupError):
    """The sample is not exported with exactly the asked labels; the message names the label sets it has."""


@dataclass(frozen=True)
class MetricSamples:
    values: dict[Key, float]

    @classmethod
    def parse(cls, text: str) -> MetricSamples:
        """Every sample of an exposition text; ValueError on a malformed line."""
        return cls({(s.name, frozenset(s.labels.items())): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples})

    def get(self, name: str, labels: Mapping[str, str] | None = None,
            default: float | None = None) -> float | None:
        """The sample `name{labels}` (exactly those labels), or `default` when it is not exported."""
        return self.values.get((name, frozenset((labels or {}).items())), default)

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The sample `name{labels}`; MissingSample naming the label sets `name` does have when absent."""
        found = self.get(name, labels)
        if found is None:
            present = sorted(str(dict(sorted(series.items()))) for series, _ in self.series(name))
            raise MissingSample(f"{name}{dict(labels or {})} not exported; label sets of {name}: {present}")
        return found

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every label set of `name` with its value (empty when `name` is not exported)."""
        return [(dict(labels), value) for (sample, labels), value in self.values.items() if sample == name]

    def total(self, name: str) -> float | None:
        """`name` summed over its label sets, or None when it is not exported."""
        values = [value for _, value in self.series(name)]
        return sum(values) if values else None


def scrape(metrics_address: str, timeout: float = 10.0) -> MetricSamples:
    """GET http://<metrics_address>/metrics within `timeout` seconds and parse it; ScrapeFailed naming the
    address and the cause otherwise."""
    url = f"http://{metrics_address}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return MetricSamples.parse(reply.read().decode())
    except (OSError, http.client.HTTPException, ValueError) as cause:  # URLError, timeout, bad text
        raise ScrapeFailed(f"cannot read metrics from {url}: {cause!r}") from cause
