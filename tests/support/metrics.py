"""Tests read a service's /metrics through the product's own reader (one implementation):
`scrape(address).value(name, labels)` / `.get(name, labels, default)`; see services/runtime/metrics_scrape.py."""

from services.runtime.metrics_scrape import MetricSamples, MissingSample, ScrapeFailed, scrape

__all__ = ["MetricSamples", "MissingSample", "ScrapeFailed", "scrape"]
