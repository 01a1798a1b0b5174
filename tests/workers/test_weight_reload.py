"""Workers follow the trainer's published weights (real etcd, a real trainer and decode worker process):
after PublishWeights the worker serves the new version (metric), a greedy generation equals the offline
one under the published checkpoint, and nothing cached under the old weights is found any more; a bad
announcement is skipped; a request in flight when a version arrives finishes under its old weights."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import torch

from k3.v1 import common_pb2, decode_pb2, decode_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from k3core.cache.hashing import chain_hashes
from k3core.model.k3model import K3Model
from k3core.presets import preset
from k3core.weights.checkpoint import load_into, save_checkpoint
from services.engine.params import GenerationOptions
from services.runtime.client import aio_channel, sync_channel
from services.runtime.registry import connect
from tests.support.metrics import scrape
from tests.workers.client import generate
from tests.workers.oracle import build_reference, offline_generate

PREFIX = "/k3-weight-reload"
HASH_BLOCK = 16
PROMPT = [(11 * i) % 200 + 3 for i in range(40)]
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def served_version(proc) -> float:
    return scrape(proc.info["metrics_address"]).value("k3_decode_weights_version")


def wait_for(condition, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


async def probe(address: str) -> int:
    """Tokens of a 48-token sequence starting with PROMPT the worker could restore (one is always left to
    compute, so 32 is the most: the prompt's KDA checkpoint sits at its last hash boundary)."""
    sequence = (PROMPT + [5] * 8)[:48]
    async with aio_channel(address) as channel:
        reply = await decode_pb2_grpc.DecodeServiceStub(channel).ProbePrefix(decode_pb2.ProbePrefixRequest(
            block_hashes=chain_hashes(sequence, HASH_BLOCK), hash_block_tokens=HASH_BLOCK), timeout=30)
    return reply.hit_tokens


def tokens_and_usage(chunks: list[common_pb2.TokenChunk]) -> tuple[list[int], common_pb2.Usage]:
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


async def collect(stream) -> list[int]:
    tokens: list[int] = []
    while (reply := await stream.read()) is not grpc.aio.EOF:
        tokens += reply.chunk.token_ids
    return tokens


def load_published(location) -> K3Model:
    model = K3Model(preset("nano"))
    load_into(model, location)
    return model.eval()


def trajectory(tokens: list[int], reward: float) -> trainer_pb2.Trajectory:
    n = len(tokens)
    return trainer_pb2.Trajectory(session=common_pb2.SessionRef(session_id="s"), tokens=common_pb2.TokenIds(ids=tokens),
                                  logprobs=[0.0] * n, loss_mask=[0] * 4 + [1] * (n - 4), reward=reward)


@pytest.mark.timeout(240)
async def test_decode_worker_serves_published_weights(spawn, etcd_server, tmp_path):
    etcd = ["--etcd-endpoints", etcd_server, "--etcd-prefix", PREFIX]
    trainer = spawn("serve", "trainer", "--port", "0", "--metrics-port", "-1", "--batch-size", "2", "--lr", "0.05",
                    "--publish-dir", str(tmp_path / "weights"), *etcd, name="trainer")
    decode = spawn("serve", "decode", "--port", "0", "--metrics-port", "0", "--model", "nano",
                   "--hash-block-tokens", str(HASH_BLOCK), "--step-token-budget", "64", "--num-pages", "160",
                   *etcd, name="decode")
    options = GenerationOptions.from_proto(GREEDY, vocab_size=preset("nano").vocab_size, max_tokens_limit=64)
    old_expected = offline_generate(build_reference("nano"), PROMPT, options)
    old, _ = tokens_and_usage(await generate(decode.address, "before", PROMPT, GREEDY))
    assert old == old_expected and served_version(decode) == 0
    assert await probe(decode.address) == 32  # the prompt's two full hash blocks and their KDA checkpoint

    with sync_channel(trainer.address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        step = stub.SubmitTrajectories(trainer_pb2.SubmitTrajectoriesRequest(trajectories=[
            trajectory(PROMPT[:12], 1.0), trajectory(PROMPT[12:24], 0.0)]))
        assert step.step == 1
        assert stub.PublishWeights(trainer_pb2.PublishWeightsRequest(version=1)).workers_updated == 1
    wait_for(lambda: served_version(decode) == 1, "the worker to serve version 1")

    assert await probe(decode.address) == 0  # nothing computed under the old weights is found
    published = load_published(tmp_path / "weights" / "v1")
    new_expected = offline_generate(published, PROMPT, options)
    assert new_expected != old_expected  # the step changed what greedy decoding picks
    new, usage = tokens_and_usage(await generate(decode.address, "after", PROMPT, GREEDY))
    assert new == new_expected and usage.cached_tokens == 0

    # A broken announcement is logged and skipped: the worker keeps serving version 1.
    client = connect([etcd_server])
    client.put(f"{PREFIX}/weights/nano", json.dumps({"version": 2, "location": str(tmp_path / "missing")}))
    client.close()
    wait_for(lambda: "weights not loaded" in decode.log(), "the bad version to be rejected")
    assert served_version(decode) == 1
    again, usage = tokens_and_usage(await generate(decode.address, "again", PROMPT, GREEDY))
    assert again == new_expected and usage.cached_tokens == 32  # cached under version 1: reused

    # A request in flight when a version arrives finishes under the weights it started with.
    torch.manual_seed(3)
    with torch.no_grad():
        for p in published.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_checkpoint(tmp_path / "v3", published.state_dict(), published.config)
    long_greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    long_options = GenerationOptions.from_proto(long_greedy, vocab_size=preset("nano").vocab_size, max_tokens_limit=512)
    async with aio_channel(decode.address) as channel:
        stream = decode_pb2_grpc.DecodeServiceStub(channel).Generate(decode_pb2.GenerateRequest(
            request_id="in-flight", prompt=common_pb2.TokenIds(ids=PROMPT), sampling=long_greedy), timeout=120)
        long_tokens = list((await stream.read()).chunk.token_ids)  # the request holds KV from here on
        client = connect([etcd_server])
        client.put(f"{PREFIX}/weights/nano", json.dumps({"version": 3, "location": str(tmp_path / "v3")}))
        client.close()
        rest = asyncio.create_task(collect(stream))
        await asyncio.to_thread(wait_for, lambda: "swapping once no request holds KV" in decode.log(), "v3 loaded")
        assert not rest.done() and served_version(decode) == 1  # not vacuous
        long_tokens += await rest
    assert long_tokens == offline_generate(load_published(tmp_path / "weights" / "v1"), PROMPT, long_options)
    wait_for(lambda: served_version(decode) == 3, "the worker to serve version 3")
    final, usage = tokens_and_usage(await generate(decode.address, "final", PROMPT, GREEDY))
    assert final == offline_generate(published, PROMPT, options) and usage.cached_tokens == 0
