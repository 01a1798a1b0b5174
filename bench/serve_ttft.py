"""bench/serve.py TTFT: a long prompt uncached, then the same prefix restored from the prefix cache."""

from __future__ import annotations

import math
import time

from bench.serve_rank import Rank, sync


def ttft(rank: Rank, prefix: list[int], increment: int) -> dict:
    """Time to first token of `prefix` + `increment` new tokens, uncached and with the prefix cached (MLA
    blocks + the KDA checkpoint at the prefix end)."""
    rank.prefill("warm", [(t * 5) % rank.vocab + 1 for t in prefix[:2048]])  # warm kernels and allocator, no shared prefix
    rank.finish(["warm"])
    rank.budget = math.gcd(rank.budget, len(prefix))  # a forward ends at the prefix: its checkpoint is kept
    sync()
    started = time.perf_counter()
    rank.prefill("miss", prefix + [5] * increment)
    sync()
    uncached = time.perf_counter() - started
    rank.finish(["miss"], keep_turn=True)
    started = time.perf_counter()
    _, hit = rank.prefill("hit", prefix + [9] * increment)
    sync()
    cached = time.perf_counter() - started
    rank.finish(["hit"])
    return {"prefix": len(prefix), "increment": increment, "uncached_s": uncached, "cached_s": cached,
            "hit_tokens": hit, "speedup": uncached / cached}
