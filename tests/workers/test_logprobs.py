"""Per-token log-probs from serving, against a float64 oracle: the batched sampler helper in process, then
real prefill/decode worker processes against the offline reference model's logits."""

from __future__ import annotations

import json
import math

import grpc
import pytest
import torch

from k3.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.engine.params import GenerationOptions
from services.engine.sampler import token_logprobs
from services.runtime.client import aio_channel
from tests.workers.client import generate
from tests.workers.cluster import OVERRIDES, make, start_all, worker_args
from tests.workers.oracle import build_reference, offline_generate


def oracle_logprobs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """float64, written independently of the sampler: greedy = log-softmax of the raw logits; sampled =
    log-softmax of logits / T with everything below the k-th score removed."""
    scores = logits.double()
    if temperature == 0:
        return torch.log_softmax(scores, -1)
    scores = scores / temperature
    if top_k:
        kth = torch.sort(scores, descending=True).values[top_k - 1]
        scores = torch.where(scores >= kth, scores, torch.tensor(-math.inf, dtype=torch.float64))
    return torch.log_softmax(scores, -1)


def options(temperature: float = 0.0, top_k: int = 0, top_logprobs: int = 0) -> GenerationOptions:
    return GenerationOptions(temperature=temperature, top_k=top_k, top_p=1.0, seed=0, max_tokens=8, stop=(),
                             stop_token_ids=frozenset(), ignore_eos=True, logprobs=True, top_logprobs=top_logprobs)


def check(got: common_pb2.TokenLogprob, want: torch.Tensor, token: int, top_n: int, tol: float = 2e-5) -> None:
    """tol: float32 rounding only in process; the workers' paged float32 forward differs from the
    reference model's contiguous one by ~1e-5 in the logits, hence 1e-4 there."""
    assert got.token_id == token
    assert got.logprob == pytest.approx(float(want[token]), abs=tol)
    finite = int(torch.isfinite(want).sum())
    assert len(got.top) == min(top_n, finite)
    order = torch.sort(want, descending=True)
    for rank, alt in enumerate(got.top):
        assert alt.logprob == pytest.approx(float(order.values[rank]), abs=tol)
        assert float(want[alt.token_id]) == pytest.approx(alt.logprob, abs=tol)


def test_batched_logprobs_equal_float64_oracle_for_asked_rows():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    rows = [(0, options(), 7), (2, options(0.7, 5, top_logprobs=8), 11), (4, options(1.3, 0, top_logprobs=20), 299)]
    got = token_logprobs(logits, rows)
    assert len(got) == 3
    check(got[0], oracle_logprobs(logits[0], 0, 0), 7, 0)
    # top_k 5 < top_logprobs 8: only the 5 tokens that could be drawn are alternatives.
    check(got[1], oracle_logprobs(logits[2], 0.7, 5), 11, 8)
    check(got[2], oracle_logprobs(logits[4], 1.3, 0), 299, 20)
    assert token_logprobs(logits, []) == []


@pytest.fixture(scope="module")
def reference():
    return build_reference("nano", OVERRIDES)


@torch.no_grad()
def reference_logits(model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The reference model's logits before each generated token (whole-prompt prefill, then step decode)."""
    cache = model.new_sequence_cache()
    rows = [model.prefill(torch.tensor(prompt), cache, 0)[-1]]
    for token in tokens[:-1]:
        rows.append(model.decode(torch.tensor([token]), [cache])[0])
    return rows


CASES = [common_pb2.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3),
         common_pb2.SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=6, ignore_eos=True, logprobs=True,
                                   top_logprobs=4)]


def expected(reference, prompt, sampling) -> tuple[list[int], list[torch.Tensor]]:
    opts = GenerationOptions.from_proto(sampling, vocab_size=reference.config.vocab_size, max_tokens_limit=1000)
    tokens = offline_generate(reference, prompt, opts)
    logits = reference_logits(reference, prompt, tokens)
    return tokens, [oracle_logprobs(row, sampling.temperature, sampling.top_k) for row in logits]


@pytest.mark.parametrize("case", range(len(CASES)))
async def test_colocated_generate_streams_logprobs_of_the_drawn_distribution(workers, reference, case):
    sampling, prompt = CASES[case], list(range(5, 30))
    chunks = await generate(workers["decode", 1].address, f"lp-colo-{case}", prompt, sampling)
    tokens, wanted = expected(reference, prompt, sampling)
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    got = [lp for c in chunks for lp in c.logprobs]
    for lp, want, token in zip(got, wanted, tokens, strict=True):
        check(lp, want, token, sampling.top_logprobs, 1e-4)


async def test_prefill_first_token_logprob_travels_to_the_decode_stream(workers, reference):
    sampling, prompt = CASES[1], list(range(9, 45))
    async with aio_channel(workers["prefill", 2].address) as channel:
        result = await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id="lp-dis", prompt=common_pb2.TokenIds(ids=prompt), sampling=sampling), timeout=120)
    async with aio_channel(workers["decode", 1].address) as channel:
        stream = decode_pb2_grpc.DecodeServiceStub(channel).DecodeFromHandle(decode_pb2.DecodeFromHandleRequest(
            request_id="lp-dis", prompt=common_pb2.TokenIds(ids=prompt), sampling=sampling, handle=result.handle,
            first_token=result.first_token, first_token_logprob=result.first_token_logprob), timeout=120)
        chunks = [reply.chunk async for reply in stream]
    tokens, wanted = expected(reference, prompt, sampling)
    check(result.first_token_logprob, wanted[0], tokens[0], sampling.top_logprobs, 1e-4)
    got = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in got] == tokens
    for lp, want, token in zip(got, wanted, tokens, strict=True):
        check(lp, want, token, sampling.top_logprobs, 1e-4)


@pytest.mark.parametrize(("sampling", "field"), [
    (common_pb2.SamplingParams(max_tokens=4, logprobs=True, top_logprobs=21), "sampling.top_logprobs"),
    (common_pb2.SamplingParams(max_tokens=4, top_logprobs=2), "sampling.top_logprobs")])
async def test_bad_top_logprobs_is_invalid_argument_naming_the_field(workers, sampling, field):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(workers["decode", 1].address, "lp-bad", [1, 2, 3], sampling)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.details()


async def test_decode_from_handle_without_the_first_logprob_is_refused(workers):
    sampling = common_pb2.SamplingParams(max_tokens=4, logprobs=True)
    async with aio_channel(workers["decode", 1].address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await decode_pb2_grpc.DecodeServiceStub(channel).DecodeFromHandle(decode_pb2.DecodeFromHandleRequest(
                request_id="lp-nofirst", prompt=common_pb2.TokenIds(ids=[1, 2]), sampling=sampling,
                handle=common_pb2.KVHandle(handle_id="h"), first_token=3), timeout=30).read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first_token_logprob" in caught.value.details()


@pytest.fixture(scope="module")
def speculative_decode(tmp_path_factory, transfer):
    draft = ["--draft-model", "nano", "--draft-model-overrides", json.dumps(OVERRIDES), "--num-speculative-tokens", "2"]
    proc = make(tmp_path_factory.mktemp("lp-spec"), "decode", worker_args("decode", 1, transfer.address, *draft))
    try:
        start_all([proc])
        yield proc
    finally:
        proc.kill()


@pytest.mark.parametrize("case", range(len(CASES)))
async def test_speculative_decode_worker_streams_logprobs_of_the_target(speculative_decode, reference, case):
    """Through gRPC on a worker with a draft model: every emitted token (accepted draft or the target's own)
    carries its log-prob under the target's distribution. Greedy tokens equal the reference's; sampled ones
    differ in draws (tests/workers/test_speculative_logprobs.py checks those in process)."""
    sampling, prompt = CASES[case], list(range(5, 30))
    chunks = await generate(speculative_decode.address, f"lp-spec-{case}", prompt, sampling)
    tokens = [t for c in chunks for t in c.token_ids]
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    logits = reference_logits(reference, prompt, tokens)
    if sampling.temperature == 0:
        assert tokens == expected(reference, prompt, sampling)[0]
    for lp, row, token in zip([lp for c in chunks for lp in c.logprobs], logits, tokens, strict=True):
        check(lp, oracle_logprobs(row, sampling.temperature, sampling.top_k), token, sampling.top_logprobs, 1e-4)
