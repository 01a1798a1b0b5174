"""Prometheus metrics of the KV transfer service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

BYTES_IN = Counter("k3_kvtransfer_bytes_in_total", "Page bytes received from producer ranks")
BYTES_OUT = Counter("k3_kvtransfer_bytes_out_total", "Page bytes streamed to consumer ranks (re-laid)")
FINGERPRINT_ERRORS = Counter("k3_kvtransfer_fingerprint_errors_total", "Pages that failed their fingerprint")
RESUMED_PUSHES = Counter("k3_kvtransfer_resumed_pushes_total", "Push streams that resumed a part")
REJECTED_FULL = Counter("k3_kvtransfer_rejected_full_total", "Pushes refused because the store was full")
HANDLES_HELD = Gauge("k3_kvtransfer_handles_held", "Handles staged in the store")
BYTES_HELD = Gauge("k3_kvtransfer_bytes_held", "Page bytes staged in the store")
THROUGHPUT = Gauge("k3_kvtransfer_bytes_per_second", "Bytes moved per second of stream time")
