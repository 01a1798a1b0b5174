"""Which instances inside the target cluster serve a session's request.

Decode: the worker that can restore the longest prefix of the prompt (its ProbePrefix answer counts a KV
hit only where a KDA checkpoint exists at that hash boundary), else the least loaded. Only the session's
first `fanout` workers in rendezvous order are probed, which bounds the RPCs per decision and keeps a
session on the same worker while it is healthy. Prefill and transfer: the session's rendezvous choice.
A worker that does not answer within the timeout is skipped; if none answers, the rendezvous choice wins.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from k3.v1 import decode_pb2, decode_pb2_grpc
from services.router.placement import rendezvous_rank
from services.runtime.registry import InstanceRecord

log = logging.getLogger("k3.router.workers")


@dataclass(frozen=True)
class DecodeChoice:
    instance: InstanceRecord
    hit_tokens: int


class DecodeChooser:
    def __init__(self, channel_for: Callable[[str], grpc.aio.Channel], fanout: int, timeout_s: float):
        self.channel_for = channel_for
        self.fanout = fanout
        self.timeout_s = timeout_s

    async def choose(self, session_id: str, workers: Sequence[InstanceRecord], block_hashes: Sequence[int],
                     hash_block_tokens: int) -> DecodeChoice | None:
        ranked = rendezvous_rank(session_id, workers)[: self.fanout]
        if not ranked:
            return None
        answers = await asyncio.gather(*(self._probe(w, block_hashes, hash_block_tokens) for w in ranked))
        scored = []
        for rank, answer in enumerate(answers):
            if answer is not None:
                hit, load = answer
                scored.append((-hit, load, rank))
        if not scored:
            return DecodeChoice(ranked[0], 0)
        neg_hit, _, rank = min(scored)
        worker, hit = ranked[rank], -neg_hit
        return DecodeChoice(worker, hit)

    async def _probe(self, worker: InstanceRecord, block_hashes: Sequence[int],
                     hash_block_tokens: int) -> tuple[int, int] | None:
        """(restorable tokens, running + waiting) or None when the worker does not answer in time."""
        stub = decode_pb2_grpc.DecodeServiceStub(self.channel_for(worker.address))
        calls = [stub.GetDecodeLoad(decode_pb2.GetDecodeLoadRequest(), timeout=self.timeout_s)]
        if block_hashes:
            calls.append(stub.ProbePrefix(decode_pb2.ProbePrefixRequest(
                block_hashes=block_hashes, hash_block_tokens=hash_block_tokens), timeout=self.timeout_s))
        try:
            load, *probe = await asyncio.gather(*calls)
            return (probe[0].hit_tokens if probe else 0), load.load.running + load.load.waiting
        except grpc.aio.AioRpcError as exc:
            log.warning("decode worker did not answer the probe",
                        extra={"worker": worker.instance, "code": exc.code().name})
            return None
