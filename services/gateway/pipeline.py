"""The serving path of one request: route -> admit -> prefill -> transfer -> decode -> stream.

Failover: an attempt that fails before its first token (cluster down, worker killed, draining) is retried on
the next cluster the router names for the session, which is its pre-assigned backup; admission is asked again
with `failover=True` so the re-prefill spends the failover share. Mid-stream failure: when
`resume_mid_stream` is on, the gateway continues on the backup by re-prefilling the prompt plus the tokens
already streamed, so the client sees one uninterrupted stream (greedy decoding continues exactly; sampled
decoding continues from the same distribution with the request's seed advanced); otherwise the stream ends
with a retriable error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from k3.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from k3core.cache.hashing import chain_hashes
from services.gateway import metrics
from services.gateway.peers import Peers
from services.runtime import errors

log = logging.getLogger("k3.gateway")

# Worker failures that mean "this cluster cannot serve it now": try the backup.
FAILOVER_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED}
ROUTE_RETRY_S = 0.2


@dataclasses.dataclass
class Job:
    request_id: str
    session: common_pb2.SessionRef
    prompt: list[int]
    sampling: common_pb2.SamplingParams
    model: str
    turn_boundaries: list[int]


@dataclasses.dataclass
class Event:
    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    cluster: str = ""
    cached_tokens: int = 0
    logprobs: list[common_pb2.TokenLogprob] = dataclasses.field(default_factory=list)


class AttemptFailed(Exception):
    def __init__(self, cluster: str, code: grpc.StatusCode, message: str):
        super().__init__(f"{cluster}: {code.name}: {message}")
        self.cluster, self.code = cluster, code


class Pipeline:
    def __init__(self, peers: Peers, max_attempts: int, timeout_s: float, resume_mid_stream: bool,
                 route_wait_s: float = 0.0, hash_block_tokens: int = 512):
        self.peers = peers
        self.hash_block_tokens = hash_block_tokens
        self.route_wait_s = route_wait_s
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.resume_mid_stream = resume_mid_stream

    async def run(self, job: Job) -> AsyncIterator[Event]:
        """`_serve` with the gateway's metrics: outcome, time to first token, requests in flight."""
        started, first, outcome = time.perf_counter(), True, "cancelled"
        metrics.IN_FLIGHT.inc()
        try:
            async for event in self._serve(job):
                if first and event.token_ids:
                    metrics.TTFT.observe(time.perf_counter() - started)
                    first = False
                yield event
            outcome = "ok"
        except errors.ServiceError as exc:
            outcome = exc.code.name.lower()
            raise
        finally:
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(outcome).inc()

    async def _serve(self, job: Job) -> AsyncIterator[Event]:
        excluded: list[str] = []
        sent: list[int] = []
        failover = False
        last_error: AttemptFailed | None = None
        for _attempt in range(self.max_attempts):
            route = await self._route(job, excluded)
            cluster = route.target.name
            resumed = job if not sent else self._continuation(job, sent)
            ticket = await self._admit(resumed, cluster, failover or route.failover, route.expected_hit_tokens)
            prefill_released = False
            try:
                async for event in self._attempt(resumed, route):
                    event.cluster = cluster
                    if event.token_ids and not prefill_released:
                        # The prefill part of the cost is what delays others' first tokens: give it back now.
                        await self._release(ticket, prefill_done=True)
                        prefill_released = True
                    sent.extend(event.token_ids)
                    yield event
                    if event.finish_reason:
                        return
                return
            except AttemptFailed as exc:
                last_error = exc
                metrics.FAILOVERS.labels("mid_stream" if sent else "before_first_token").inc()
                log.warning("attempt failed; trying the backup", extra={"cluster": cluster, "error": str(exc),
                                                                         "tokens_sent": len(sent)})
                if sent and not self.resume_mid_stream:
                    raise errors.Unavailable(f"cluster {cluster} failed mid-stream after {len(sent)} tokens; "
                                             "retry the request", retry_after_ms=200) from exc
                excluded.append(cluster)
                failover = True
            finally:
                await self._release(ticket)
        raise errors.Unavailable(f"no cluster could serve the request: {last_error}", retry_after_ms=500)

    def _continuation(self, job: Job, sent: list[int]) -> Job:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(job.sampling)
        sampling.max_tokens = job.sampling.max_tokens - len(sent)
        sampling.seed = (job.sampling.seed + len(sent)) % 2**64
        return dataclasses.replace(job, prompt=job.prompt + sent, sampling=sampling,
                                   request_id=f"{job.request_id}-r{len(sent)}")

    async def _route(self, job: Job, excluded: list[str]) -> router_pb2.RouteResponse:
        """Ask a router; while none is registered or it has no healthy cluster (membership reconverging after
        an etcd outage, the lease-TTL gap before a backup is known), wait up to `route_wait_s`."""
        deadline = time.monotonic() + self.route_wait_s
        while True:
            try:
                return await self._route_once(job, excluded)
            except errors.Unavailable:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(ROUTE_RETRY_S)

    async def _route_once(self, job: Job, excluded: list[str]) -> router_pb2.RouteResponse:
        address = self.peers.pick("router")
        if address is None:
            raise errors.Unavailable("no session router is registered", retry_after_ms=500)
        stub = router_pb2_grpc.RouterServiceStub(self.peers.channel(address))
        request = router_pb2.RouteRequest(session=job.session, exclude_clusters=excluded,
                                          block_hashes=chain_hashes(job.prompt, self.hash_block_tokens),
                                          hash_block_tokens=self.hash_block_tokens)
        try:
            return await stub.Route(request, timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise errors.InvalidArgument("", f"router: {exc.details()}") from exc
            raise errors.Unavailable(f"router: {exc.details()}", retry_after_ms=500) from exc

    async def _admit(self, job: Job, cluster: str, failover: bool, cached_tokens: int) -> str:
        """Admission charges the uncached part of the prompt: the router's expected prefix hit is free."""
        address = self.peers.pick("admission")
        if address is None:
            return ""  # No admission controller in this fleet: admit everything.
        stub = admission_pb2_grpc.AdmissionServiceStub(self.peers.channel(address))
        try:
            reply = await stub.Admit(admission_pb2.AdmitRequest(
                request_id=job.request_id, session=job.session, prompt_tokens=len(job.prompt),
                cached_tokens=min(cached_tokens, len(job.prompt)), max_output_tokens=job.sampling.max_tokens,
                cluster=cluster, failover=failover),
                timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                retry = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "1000")
                raise errors.ResourceExhausted(f"admission: {exc.details()}", retry_after_ms=int(retry)) from exc
            raise errors.Unavailable(f"admission: {exc.details()}", retry_after_ms=500) from exc
        return reply.ticket

    async def _release(self, ticket: str, prefill_done: bool = False) -> None:
        address = self.peers.pick("admission") if ticket else None
        if address is None:
            return
        stub = admission_pb2_grpc.AdmissionServiceStub(self.peers.channel(address))
        try:
            await stub.ReleaseTicket(admission_pb2.ReleaseTicketRequest(ticket=ticket, prefill_done=prefill_done),
                                     timeout=5)
        except grpc.aio.AioRpcError as exc:
            log.warning("ticket release failed (it expires on its own)", extra={"error": exc.details()})

    async def _attempt(self, job: Job, route: router_pb2.RouteResponse) -> AsyncIterator[Event]:
        cluster = route.target.name
        try:
            if route.prefill.address:
                stream = self._disaggregated(job, route)
            else:
                stream = self._colocated(job, route)
            async for event in stream:
                yield event
        except grpc.aio.AioRpcError as exc:
            if exc.code() in FAILOVER_CODES:
                raise AttemptFailed(cluster, exc.code(), exc.details() or "") from exc
            raise _client_error(exc) from exc

    async def _disaggregated(self, job: Job, route: router_pb2.RouteResponse) -> AsyncIterator[Event]:
        prefill = prefill_pb2_grpc.PrefillServiceStub(self.peers.channel(route.prefill.address))
        started = time.perf_counter()
        result = await prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=job.request_id, session=job.session, prompt=common_pb2.TokenIds(ids=job.prompt),
            sampling=job.sampling, model=job.model, turn_boundaries=job.turn_boundaries,
            transfer_address=route.transfer.address, decode_target=route.decode), timeout=self.timeout_s)
        log.info("prefilled", extra={"cluster": route.target.name, "ms": round(1e3 * (time.perf_counter() - started), 1),
                                     "cached_tokens": result.cached_tokens})
        decode = decode_pb2_grpc.DecodeServiceStub(self.peers.channel(route.decode.address))
        stream = decode.DecodeFromHandle(decode_pb2.DecodeFromHandleRequest(
            request_id=job.request_id, session=job.session, prompt=common_pb2.TokenIds(ids=job.prompt),
            sampling=job.sampling, handle=result.handle, first_token=result.first_token, model=job.model,
            transfer_address=route.transfer.address,
            first_token_logprob=result.first_token_logprob if result.HasField("first_token_logprob") else None),
            timeout=self.timeout_s)
        async for reply in stream:
            yield Event(list(reply.chunk.token_ids), reply.chunk.finish_reason,
                        cached_tokens=result.cached_tokens, logprobs=list(reply.chunk.logprobs))

    async def _colocated(self, job: Job, route: router_pb2.RouteResponse) -> AsyncIterator[Event]:
        if not route.decode.address:
            raise AttemptFailed(route.target.name, grpc.StatusCode.UNAVAILABLE, "no decode worker in cluster")
        decode = decode_pb2_grpc.DecodeServiceStub(self.peers.channel(route.decode.address))
        stream = decode.Generate(decode_pb2.GenerateRequest(
            request_id=job.request_id, session=job.session, prompt=common_pb2.TokenIds(ids=job.prompt),
            sampling=job.sampling, model=job.model, turn_boundaries=job.turn_boundaries), timeout=self.timeout_s)
        async for reply in stream:
            chunk = reply.chunk
            yield Event(list(chunk.token_ids), chunk.finish_reason, cached_tokens=chunk.usage.cached_tokens,
                        logprobs=list(chunk.logprobs))


def _client_error(exc: grpc.aio.AioRpcError) -> errors.ServiceError:
    """A worker rejected the request itself (bad input): pass it on, no failover."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.InvalidArgument("", exc.details() or "invalid request")
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return errors.NotFound(exc.details() or "not found")
    return errors.FailedPrecondition(f"{exc.code().name}: {exc.details()}")


def new_request_id() -> str:
    return "req-" + uuid.uuid4().hex[:20]
