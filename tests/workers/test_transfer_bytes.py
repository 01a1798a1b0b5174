"""Bytes a TP 2 prefill pushes into the transfer service, against a hand count: every KDA head of every
KDA state page once, and the replicated MLA pages once (rank 0 sends them, rank 1 only its KDA heads)."""

from __future__ import annotations

import json
import math

from k3.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from k3core.presets import preset
from services.engine.config import WorkerConfig
from services.kvtransfer.grpc_transport import GrpcTransport
from services.runtime.client import aio_channel
from tests.workers.cluster import HASH_BLOCK, OVERRIDES

PROMPT_TOKENS = 70
FLOAT32 = 4  # the workers' default dtype (KDA recurrent state, conv tails and MLA latent)


def hand_counted_bytes(tp: int, mla_sends: int) -> tuple[int, int]:
    """(KDA bytes, MLA bytes) of one handle when `mla_sends` ranks send the MLA pages."""
    config = preset("nano").replace(**OVERRIDES)
    layout = WorkerConfig(model="nano", model_overrides=json.dumps(OVERRIDES), tp_size=tp,
                          hash_block_tokens=HASH_BLOCK).pool_layout()
    per_group, block = layout.layers_per_group, layout.tokens_per_block  # the pool's grouping choices
    d, w = config.kda_head_dim, config.short_conv_kernel_size
    per_head_layer = d * d * FLOAT32 + 3 * d * (w - 1) * FLOAT32  # recurrent state + q/k/v conv tails
    kda_groups = math.ceil(len(config.kda_layers) / per_group)
    kda = kda_groups * per_group * config.kda_num_heads * per_head_layer  # all heads, summed over ranks
    mla_groups = math.ceil(len(config.mla_layers) / per_group)
    blocks = math.ceil(PROMPT_TOKENS / block)
    mla_page = per_group * block * config.mla_latent_dim * FLOAT32
    return kda, mla_sends * blocks * mla_groups * mla_page


async def test_tp2_prefill_sends_mla_pages_once(workers, transfer):
    stats = GrpcTransport(transfer.address)
    try:
        before = (await stats.stats()).bytes_in
        async with aio_channel(workers["prefill", 2].address) as channel:
            result = await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id="bytes-tp2", prompt=common_pb2.TokenIds(ids=list(range(5, 5 + PROMPT_TOKENS))),
                sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=120)
        received = (await stats.stats()).bytes_in - before
        kda, mla = hand_counted_bytes(2, mla_sends=1)
        assert mla > 0 and kda > 0
        assert received == kda + mla
        assert received < sum(hand_counted_bytes(2, mla_sends=2))  # what every rank sending them cost
        assert await stats.release(result.handle.handle_id)
    finally:
        await stats.close()
