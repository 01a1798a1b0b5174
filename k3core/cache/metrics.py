"""Prometheus metrics of the prefix cache, registered in a registry the caller passes in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Hit boundaries span one hash block to a million tokens.
BOUNDARY_BUCKETS = tuple(float(512 * 2**i) for i in range(12))


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str = "k3_prefix_cache") -> None:
        self.lookup_tokens = Counter(f"{prefix}_lookup_tokens", "Prompt tokens looked up", registry=registry)
        self.hit_tokens = Counter(f"{prefix}_hit_tokens", "Prompt tokens served from the cache",
                                  registry=registry)
        self.hit_boundary = Histogram(f"{prefix}_hit_boundary_tokens", "Token boundary of each hit",
                                      buckets=BOUNDARY_BUCKETS, registry=registry)
        self.checkpoint_bytes = Gauge(f"{prefix}_checkpoint_bytes", "GPU bytes held by KDA checkpoints",
                                      registry=registry)
        self.checkpoints_skipped = Counter(f"{prefix}_checkpoints_skipped",
                                           "Snapshots not taken: no room under the checkpoint cap",
                                           registry=registry)
        self.evictions = Counter(f"{prefix}_evictions", "Entries evicted from the GPU pool", ["kind"],
                                 registry=registry)
        self.cpu_tier_bytes = Counter(f"{prefix}_cpu_tier_bytes", "Bytes moved to/from the CPU tier",
                                      ["direction"], registry=registry)
        self.integrity_errors = Counter(f"{prefix}_integrity_errors",
                                        "Fingerprint mismatches (each became a cache miss)", ["where"],
                                        registry=registry)
