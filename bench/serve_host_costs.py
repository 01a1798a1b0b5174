"""Host costs bench.serve_host times apart from the engine step, each against the form it replaced or a peer
in the same run: the streams' loop handing one output to each reader (`OutputQueue` against `asyncio.Queue`),
`sample_rows` on temperature > 0 rows over the full vocabulary (device work on a GPU, host CPU here), and a
commit's checkpoint fingerprints (row-batched against per page)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from k3core.cache.hashing import checksums
from k3core.cache.page_store import PageStore
from services.engine import sampler
from services.engine.params import GenerationOptions
from services.engine.streams import OutputQueue


def stream_burst_ms(readers: int, bursts: int = 200) -> dict:
    """Event-loop ms to hand one output to each of `readers` streams and resume their readers (the loop's share
    of a step's hand-over: GIL time the engine thread shares): `RequestStream`'s `OutputQueue` against the
    `asyncio.Queue` it replaced, each timed twice, alternated, in one run (median of the two medians)."""
    async def burst_ms(make: Callable[[], OutputQueue | asyncio.Queue]) -> float:
        queues, left, done = [make() for _ in range(readers)], [0], asyncio.Event()

        async def read(queue) -> None:
            while True:
                await queue.get()
                left[0] -= 1
                if not left[0]:
                    done.set()
        tasks = [asyncio.create_task(read(queue)) for queue in queues]
        await asyncio.sleep(0)
        times = []
        for step in range(bursts):
            left[0] = readers
            done.clear()
            began = time.perf_counter()
            for queue in queues:
                queue.put_nowait(step)
            await done.wait()
            times.append(1e3 * (time.perf_counter() - began))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return float(np.percentile(times, 50))
    timed: dict[str, list[float]] = defaultdict(list)
    for name, make in (("asyncio_queue", asyncio.Queue), ("output_queue", OutputQueue)) * 2:
        timed[name].append(asyncio.run(burst_ms(make)))
    return {"readers": readers, **{f"{name}_ms": float(np.median(ms)) for name, ms in timed.items()}}


def sampled_rows_ms(vocab: int, batch: int, reps: int = 20) -> dict:
    """Host ms of `sample_rows` for `batch` temperature > 0 rows (each its own seed) over the full vocabulary
    on this CPU: on a GPU these rows are device work, here every column's draw is host CPU."""
    rows = [(row, GenerationOptions(temperature=0.7, top_k=0, top_p=1.0, seed=1 + row, max_tokens=8, stop=(),
                                    stop_token_ids=frozenset(), ignore_eos=True), 0) for row in range(batch)]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    times = []
    for index in range(reps):
        began = time.perf_counter()
        sampler.sample_rows(logits, [(row, options, index) for row, options, _ in rows])
        times.append(1e3 * (time.perf_counter() - began))
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99))}


def fingerprints_ms(pages: int, page_bytes: int, reps: int = 5) -> dict:
    """Host ms of a commit's checkpoint fingerprints over `pages` pool pages on this CPU: `PageStore.fingerprints`
    (row-batched, `checksum_rows`) against the per-page form it replaced (`checksums` of each page's bytes:
    a set of launches and an XOR fold per page). Same values asserted."""
    data = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    store = PageStore.__new__(PageStore)  # only its bytes are read
    store.data = data
    rows = list(range(pages))
    assert store.fingerprints(rows, page_bytes) == checksums([data[p] for p in rows])
    timed = {}
    for name, run in (("row_batched", lambda: store.fingerprints(rows, page_bytes)),
                      ("per_page", lambda: checksums([data[p] for p in rows]))):
        times = []
        for _ in range(reps):
            began = time.perf_counter()
            run()
            times.append(1e3 * (time.perf_counter() - began))
        timed[name] = float(np.percentile(times, 50))
    return {"pages": pages, "page_bytes": page_bytes, "row_batched_ms": timed["row_batched"],
            "per_page_ms": timed["per_page"]}
