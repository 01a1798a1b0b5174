"""The engine's side of a request's stream: accepted tokens become outputs (stop checks, metrics, the cache
manager's append), queued in order and handed to the streams after the next step's launch."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from k3.v1 import common_pb2
from services.engine import handover
from services.engine.request import EngineRequest, Phase, StepOutput
from services.engine.trace_labels import label

if TYPE_CHECKING:
    from services.engine.metrics import EngineMetrics
    from services.engine.output import OutputProcessor
    from services.engine.plan import RecordingManager


class TokenStreaming:
    """Part of `Engine` (its token acceptance and stream hand-over), kept apart to keep the loop readable."""

    output: OutputProcessor
    manager: RecordingManager
    metrics: EngineMetrics
    _outbox: list[tuple[EngineRequest, StepOutput]]
    _step_tokens: int
    # and Engine._finish, which ends a request whose token stopped it

    def _count_prompt(self, req: EngineRequest) -> None:
        if not req.output and not req.preemptions:
            self.metrics.prompt_tokens.inc(len(req.prompt) - req.cached_tokens)

    def _take(self, req: EngineRequest, token: int, logprob: common_pb2.TokenLogprob | None = None) -> None:
        """Accept a sampled token of a running request (its stream, stop checks, the manager's append)."""
        self._count_prompt(req)
        self._accept(req, token, logprob)

    def _take_rows(self, rows: Iterable[tuple[EngineRequest, int]]) -> None:
        """`_take` of one token, without logprobs, for each (request, token) in order: the same outputs,
        finishes, metrics and manager calls, with `_take` / `_accept` / `_stream`'s per-call work folded into
        one loop (a decode step's bulk: 256 rows a step; ~1 us a row less here)."""
        accept, call, outbox, unfinished = self.output.accept, self.manager.call, self._outbox.append, \
            common_pb2.FINISH_REASON_UNSPECIFIED
        count = 0
        for req, token in rows:
            self._count_prompt(req)
            output = accept(req, token)
            if output.finish_reason != unfinished:
                self._finish(req, output.finish_reason, keep_turn=True)
            ttft = self._clock(req, 1)
            outbox((req, output if ttft is None else dataclasses.replace(output, ttft_s=ttft)))
            if req.phase is Phase.RUNNING:
                call("append_tokens", req.rid, [token])
            count += 1
        self._step_tokens += count

    def _emit(self, req: EngineRequest, output: StepOutput) -> None:
        """Queue an output for the request's stream, in order. Handing it over (a cross-thread wake-up of the
        server's event loop per output) waits for `_flush`, which runs after the next step's launch (or when
        the loop idles), so it overlaps the GPU instead of delaying the next launch."""
        self._outbox.append((req, output))

    def _flush(self) -> None:
        with label("k3.stream_emit"):
            self.metrics.tpot_batch.flush()  # the TPOTs of the outputs handed over here
            outbox, self._outbox = self._outbox, []
            with handover.burst():  # one wake-up per event loop, not one per output
                for req, output in outbox:
                    req.emit(output)

    def _accept_forced(self, req: EngineRequest) -> None:
        self._accept(req, req.forced.pop(0), req.forced_logprobs.pop(0) if req.forced_logprobs else None)

    def _accept(self, req: EngineRequest, token: int, logprob: common_pb2.TokenLogprob | None = None) -> None:
        self._stream(req, [token], None if logprob is None else [logprob])
        if req.phase is Phase.RUNNING:
            self.manager.call("append_tokens", req.rid, [token])

    def _stream(self, req: EngineRequest, tokens: list[int], logprobs: list | None = None) -> int:
        """Hand a step's new tokens (and their logprobs, if any) to the request's stream in one output;
        stops at the first token that ends the request (which is then finished). Returns how many tokens
        it took."""
        outs = []
        for token in tokens:
            outs.append(self.output.accept(req, token))
            if outs[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                self._finish(req, outs[-1].finish_reason, keep_turn=True)
                break
        ttft = self._clock(req, len(outs))
        self._step_tokens += len(outs)
        if len(outs) == 1 and not logprobs:  # a decode step's one token: its output as it is
            output = outs[0]
        else:
            output = StepOutput([t for o in outs for t in o.token_ids], "".join(o.text for o in outs),
                                outs[-1].finish_reason, logprobs=(logprobs or [])[:len(outs)])
        self._emit(req, output if ttft is None else dataclasses.replace(output, ttft_s=ttft))
        return len(outs)

    def _clock(self, req: EngineRequest, count: int) -> float | None:
        """A request streams `count` new tokens now: its TTFT (returned, and observed) if they are its first,
        else `count` TPOT observations sharing the time since its last tokens."""
        now = time.monotonic()
        ttft = None
        if req.first_token_at is None:
            req.first_token_at = now
            ttft = now - req.arrival
            self.metrics.ttft.observe(ttft)
        elif req.last_token_at is not None:
            for _ in range(count):  # a window's tokens share the step's time
                self.metrics.tpot_batch.add((now - req.last_token_at) / count)
        req.last_token_at = now
        return ttft
