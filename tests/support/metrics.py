"""A service's Prometheus /metrics, read with prometheus_client's own exposition parser.

Samples are looked up by full sample name (a counter's `_total`, a histogram's `_bucket` / `_sum` / `_count`)
and by their exact label set, so `{"stage": "mid_stream"}` never matches a series that has more labels, and
label order or escaping in the text does not matter.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, frozenset[tuple[str, str]]]


@dataclass(frozen=True)
class MetricSamples:
    values: dict[Key, float]

    @classmethod
    def parse(cls, text: str) -> MetricSamples:
        return cls({(s.name, frozenset(s.labels.items())): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples})

    def get(self, name: str, labels: Mapping[str, str] | None = None,
            default: float | None = None) -> float | None:
        """The sample `name{labels}` (exactly those labels), or `default` when it is not exported."""
        return self.values.get((name, frozenset((labels or {}).items())), default)

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The sample `name{labels}`; AssertionError naming the label sets `name` does have when absent."""
        found = self.get(name, labels)
        if found is None:
            present = sorted(str(dict(sorted(key))) for n, key in self.values if n == name)
            raise AssertionError(f"{name}{dict(labels or {})} not exported; label sets of {name}: {present}")
        return found


def scrape(metrics_address: str, timeout: float = 10.0) -> MetricSamples:
    """GET http://<metrics_address>/metrics and parse it."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout) as reply:
        return MetricSamples.parse(reply.read().decode())
