"""The KV transfer service as a real process: re-layout p -> q, corruption and broken streams retried,
backpressure, bad input."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from k3.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.kvtransfer.grpc_transport import GrpcTransport
from services.kvtransfer.relayout import rank_layout
from services.runtime.client import aio_channel
from services.runtime.errors import error_detail
from tests.kvtransfer.faulty_proxy import FaultyProxy
from tests.kvtransfer.pages import GlobalCache

HEADS = 8


@pytest.fixture
def kvtransfer(spawn):
    return spawn("serve", "kvtransfer", "--port", "0", "--metrics-port", "-1", "--capacity-bytes", "400000",
                 name="kvtransfer")


async def _push_all(transport, cache, handle_id, p, whole=False):
    await asyncio.gather(*(transport.push(*cache.producer_part(handle_id, p, r, whole=whole)) for r in range(p)))


def _wire_bytes(cache: GlobalCache, p: int, whole: bool) -> int:
    """By hand: every KDA head once, the replicated MLA pages once (p times when every rank sends them)."""
    mla = sum(len(c) for c in cache.content if isinstance(c, bytes))
    kda = sum(len(head) for c in cache.content if isinstance(c, list) for head in c)
    return kda + mla * (p if whole else 1)


@pytest.mark.parametrize(("p", "q", "whole"), [(1, 1, False), (2, 1, False), (1, 2, False), (4, 2, False),
                                               (8, 4, False), (2, 2, True)])
async def test_pull_relays_for_every_consumer_rank(kvtransfer, p, q, whole):
    """`whole`: every producer rank sends the MLA pages too (older producers); the service keeps rank 0's."""
    cache = GlobalCache.random(HEADS, seed=p * 10 + q)
    transport = GrpcTransport(kvtransfer.address, max_chunk_bytes=500)
    try:
        await _push_all(transport, cache, f"h{p}{q}", p, whole)
        assert (await transport.stats()).bytes_in == _wire_bytes(cache, p, whole)
        for rank in range(q):
            layout = rank_layout(HEADS, q, rank)
            pulled = await transport.pull(f"h{p}{q}", layout)
            assert pulled.pages == cache.rank_pages(layout)
            assert pulled.handle.layout == layout and pulled.handle.num_tokens == 100
        assert await transport.release(f"h{p}{q}")
        assert not await transport.release(f"h{p}{q}")
        stats = await transport.stats()
        assert stats.bytes_per_second > 0 and stats.handles_held == 0
    finally:
        await transport.close()


@pytest.mark.parametrize("downstream", [False, True])
async def test_flipped_byte_in_flight_is_caught_and_retried(kvtransfer, downstream):
    cache = GlobalCache.random(HEADS, seed=7)
    handle, pages = cache.producer_part("flip", 2, 1)
    marker = pages[1][300:332]  # bytes of a KDA head range (rank 1 sends KDA pages only): flipped inside the payload, framing intact
    proxy = FaultyProxy(kvtransfer.address, marker=marker, downstream=downstream)
    via_proxy = GrpcTransport(await proxy.start())
    direct = GrpcTransport(kvtransfer.address)
    try:
        push = via_proxy if not downstream else direct
        await push.push(*cache.producer_part("flip", 2, 0))
        await push.push(handle, pages)
        layout = rank_layout(HEADS, 1, 0)
        pulled = await (via_proxy if downstream else direct).pull("flip", layout)
        assert proxy.flipped
        assert pulled.pages == cache.rank_pages(layout)
        stats = await direct.stats()
        if downstream:  # caught by the consumer, which resumed the pull at the damaged page
            assert via_proxy.retries >= 1 and stats.fingerprint_errors == 0
        else:  # caught by the service on arrival (DATA_LOSS), the push resumed
            assert stats.fingerprint_errors == 1 and via_proxy.retries >= 1 and stats.retries >= 1
    finally:
        await asyncio.gather(via_proxy.close(), direct.close(), proxy.stop())


async def test_broken_push_stream_resumes_without_corruption(kvtransfer):
    cache = GlobalCache.random(HEADS, seed=9, kda_pages=6)
    proxy = FaultyProxy(kvtransfer.address, cut_after=6000)
    transport = GrpcTransport(await proxy.start(), max_chunk_bytes=400)
    try:
        await _push_all(transport, cache, "cut", 1)
        assert proxy.cut and transport.retries >= 1
        pulled = await transport.pull("cut", rank_layout(HEADS, 2, 1))
        assert pulled.pages == cache.rank_pages(rank_layout(HEADS, 2, 1))
    finally:
        await asyncio.gather(transport.close(), proxy.stop())


async def test_full_store_pushes_back_until_space_frees(kvtransfer):
    big = GlobalCache.random(HEADS, seed=3, kda_pages=4, head_bytes=9000)  # ~290 KB of 400 KB
    transport = GrpcTransport(kvtransfer.address, attempts=30)
    channel = aio_channel(kvtransfer.address)
    try:
        await _push_all(transport, big, "first", 1)
        stub = kvtransfer_pb2_grpc.KVTransferServiceStub(channel)
        handle, _ = big.producer_part("second", 1, 0)
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await stub.Push(iter([kvtransfer_pb2.PushRequest(chunk=kvtransfer_pb2.PageChunk(handle=handle))]))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_detail(full.value).retry_after_ms > 0
        second = asyncio.create_task(_push_all(transport, big, "second", 1))
        await asyncio.sleep(0.5)
        assert not second.done()  # held back by the full store
        await transport.release("first")
        await asyncio.wait_for(second, 10)
        pulled = await transport.pull("second", rank_layout(HEADS, 1, 0))
        assert pulled.pages == big.rank_pages(rank_layout(HEADS, 1, 0))
    finally:
        await asyncio.gather(transport.close(), channel.close())


async def test_bad_requests_name_the_field(kvtransfer):
    channel = aio_channel(kvtransfer.address)
    stub = kvtransfer_pb2_grpc.KVTransferServiceStub(channel)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            async for _ in stub.Pull(kvtransfer_pb2.PullRequest(handle_id="nope",
                                                                consumer_layout=rank_layout(HEADS, 1, 0))):
                pass
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as no_handle:
            await stub.Push(iter([kvtransfer_pb2.PushRequest(chunk=kvtransfer_pb2.PageChunk(data=b"x"))]))
        assert no_handle.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_detail(no_handle.value).field == "chunk.handle"
        cache = GlobalCache.random(HEADS, seed=4)
        handle, _ = cache.producer_part("bad", 2, 0)
        handle.layout.head_count = 3  # does not divide the KDA pages
        with pytest.raises(grpc.aio.AioRpcError) as bad_layout:
            await stub.Push(iter([kvtransfer_pb2.PushRequest(chunk=kvtransfer_pb2.PageChunk(handle=handle))]))
        assert bad_layout.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_bytes" in error_detail(bad_layout.value).field
    finally:
        await channel.close()
