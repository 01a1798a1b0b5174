"""Decode look-ahead: step N+1 is launched before step N's tokens reach the host (on by default wherever the
decode overlap runs; K3_DECODE_LOOKAHEAD=0 turns it off).

The overlap (decode_overlap.py) prepares N+1's image while N computes, but launches it only once N's
tokens are on the host and checked, so the device idles for the copy, the host's wake-up and the stop
check between the two forwards. Here N+1 is launched at once, its tokens read on the device:

- every draw's tokens are copied, on the device, into the fast path's `drawn` buffer (`DecodeFastPath.publish`);
  N+1's image says which row of N each of its rows continues (`source`), and its graph reads the token
  there (`DecodeInputs.resolve_on_device`);
- a row whose token is one of its stop ids or the EOS (a fixed-width table in the image, `stops`) runs as
  a padding row, on the scratch pages: its request stopped at N, and its KDA state, updated in place, must
  stay the one its last token left (the plain loop never runs it again); its N+1 output is dropped;
- a row whose N token reaches its max_tokens is left out of N+1 ahead (the host knows it).

Then N's tokens are accepted (the plain loop's acceptance, in row order); the host's stops must be the
device's (else: an error, never a silent divergence); N+1's surviving rows reserve their token (a
reserve that allocates nothing: a step whose rows cross a block is not run ahead) and are marked done in
the manager, N+2 is prepared for them and N+1's step is committed, before N+2's launch: a checkpoint
taken at a hash boundary is queued behind N+1's forward, the state it must hold. The manager sees a plain
step's calls, in a plain step's order; only the forwards of rows that stopped run once more, on scratch.

Not run ahead (the overlap's step runs instead, waiting for N's tokens): a row crosses a block, a request
waits to be admitted, a row has stop strings, logprobs, forced tokens, or more stop ids than the table
holds, the batch is over the budget. Token i of a request is drawn with the same (seed, i) from the logits
of the same context as in a plain step, so the streams are the plain engine's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from services.engine.decode_inputs import STOP_WIDTH
from services.engine.metrics import Fallback
from services.engine.request import EngineRequest, Phase
from services.engine.trace_labels import label

if TYPE_CHECKING:
    from services.engine.decode_overlap import DecodeOverlap, InFlight


def stop_table(requests: list[EngineRequest], eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """([STOP_WIDTH, rows] int64: each row's stop token ids, then the EOS unless ignored, -1 padded;
    [rows] bool: the row's ids fit, else its column is left -1). Built for every row of a prepared step,
    behind the forward (`DecodeOverlap._prepare`): rows without stop ids, nearly all, get the EOS in one
    vector write; a row's own ids are written in a loop over the rows that have some."""
    n = len(requests)
    table = np.full((STOP_WIDTH, n), -1, dtype=np.int64)
    own = np.fromiter((len(r.options.stop_token_ids) for r in requests), dtype=np.int64, count=n)
    with_eos = np.fromiter((eos is not None and not r.options.ignore_eos for r in requests), dtype=bool, count=n)
    fits = own + with_eos <= STOP_WIDTH
    for k in np.flatnonzero((own > 0) & fits).tolist():
        table[: own[k], k] = sorted(requests[k].options.stop_token_ids)
    if eos is not None:
        at = np.flatnonzero(with_eos & fits)
        table[own[at], at] = eos  # after the row's own ids
    return table, fits


class DecodeLookahead:
    def __init__(self, overlap: DecodeOverlap) -> None:
        self.overlap = overlap
        self.engine = overlap.engine
        self.missed: str | None = None  # why the last `plan` was None (a `Fallback` label), counted if N+1 overlaps

    def plan(self, inflight: InFlight) -> tuple[list[int], np.ndarray] | None:
        """The rows of the in-flight step that the next step runs ahead of their tokens and their stop
        table, or None: not eligible, why in `missed` (a `Fallback` label; None where no row goes on)."""
        scheduler = self.engine.scheduler
        requests = inflight.requests
        self.missed = Fallback.BLOCK_CROSSING if inflight.crossing else Fallback.WAITING if scheduler.waiting \
            else Fallback.BATCH_CHANGED if len(scheduler.running) != len(requests) \
            else Fallback.BUDGET if len(requests) > scheduler.budget else None
        if self.missed is not None:
            return None
        if not all(req.phase is Phase.RUNNING and not req.options.stop for req in requests):
            # a cancellation (settled), or stop strings: only the host can check those
            running = all(req.phase is Phase.RUNNING for req in requests)
            self.missed = Fallback.STOP_STRINGS if running else Fallback.BATCH_CHANGED
            return None
        rows = np.flatnonzero(~inflight.always_check)  # the others' N token is their max_tokens-th
        table, fits = inflight.stops
        if not len(rows):
            return None  # every row ends with this token: no next step of these rows
        if not fits[rows].all():
            self.missed = Fallback.STOP_IDS  # a row with more stop ids than the table holds
            return None
        return rows.tolist(), table if len(rows) == len(requests) else table[:, rows]

    def stop_table(self, requests: list[EngineRequest]) -> tuple[np.ndarray, np.ndarray]:
        """The stop table of a prepared step's rows (`stop_table`), with the engine's EOS."""
        return stop_table(requests, self.engine.output.eos_token_id)

    def advance(self, inflight: InFlight, rows: list[int], stops: np.ndarray) -> None:
        """Launch the prepared step for `rows` (`plan`) with its tokens on the device, then accept the
        in-flight step's."""
        engine, overlap = self.engine, self.overlap
        requests = inflight.requests
        ahead = [requests[i] for i in rows]
        started = time.perf_counter()
        overlap.inflight = None
        fast, manager, scheduler = engine.executor.fastpath, engine.executor.manager, engine.scheduler
        with label("k3.to_launch"):
            image, size = inflight.image, inflight.size
            if len(rows) < len(requests):
                image, size = fast.compact(image, size, rows)
            source, stop_part = fast.builder.ahead_parts(image, size)
            source[: len(rows)] = rows if inflight.rows is None else inflight.rows[rows]
            stop_part[:, : len(rows)] = stops
            manager.pre_forward()
        with label("k3.launch"):
            logits = fast.launch(image, len(rows))
        engine.metrics.pipeline.lookahead.inc()
        # N's token is not appended yet: N+1 draws each request's output position len(output) + 1
        with label("k3.sample"):
            next_tokens = overlap.draw(logits, [(k, req.options, len(req.output) + 1) for k, req in enumerate(ahead)])
        with label("k3.tokens_ready"):
            tokens = inflight.token_array()
        with label("k3.accept"):
            engine._take_rows(zip(requests, tokens.tolist(), strict=True))
            scheduler.finish_leaving()
            stopped = (stops == tokens[rows][None]).any(0).tolist()
            live = [k for k, req in enumerate(ahead) if req.phase is Phase.RUNNING]
            for k, req in enumerate(ahead):
                if (req.phase is not Phase.RUNNING) != stopped[k]:
                    raise RuntimeError(f"request {req.rid!r}: the device's stop check disagrees with the host's")
            for k in live:
                manager.reserve(ahead[k].rid, 1)  # allocates nothing: no row crosses a block
            for k in live:
                manager.forward_done(ahead[k].rid)
            engine.manager.take_calls()  # at TP 1 nobody replays the recorded calls
        overlap._hand_over([ahead[k] for k in live], next_tokens, np.array(live), started)
