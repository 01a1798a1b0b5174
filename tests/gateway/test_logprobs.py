"""OpenAI `logprobs` / `top_logprobs` on chat completions through a real one-cluster fleet (etcd, router,
admission, gateway, kvtransfer, prefill, decode processes; `k3 up` as in tests/fleet), read with the
official `openai` client and checked against a float64 log-softmax of the offline reference model."""

from __future__ import annotations

import openai
import pytest
import torch

from k3.v1 import common_pb2
from k3core.chat.render import render_chat
from k3core.tokenizer import ByteTokenizer
from services.engine.params import GenerationOptions
from tests.fleet.k3cli import running_fleet, state
from tests.workers.oracle import build_reference, offline_generate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    home = tmp_path_factory.mktemp("k3home")
    with running_fleet(home, "--clusters", "1", "--lease-ttl-s", "2"):
        gateway = next(m for m in state(home).members if m.service == "gateway")
        yield openai.OpenAI(base_url=f"http://{gateway.extra['http_address']}/v1", api_key="no-auth",
                            max_retries=0, timeout=120)


@torch.no_grad()
def oracle(max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of the rendered conversation and the float64 log-softmax before each of them."""
    tokenizer = ByteTokenizer()
    prompt = render_chat(tokenizer, MESSAGES, thinking=False).tokens
    model = build_reference("nano")
    options = GenerationOptions.from_proto(common_pb2.SamplingParams(max_tokens=max_tokens), vocab_size=model.config.vocab_size,
                                           max_tokens_limit=100)
    tokens = offline_generate(model, prompt, options)
    cache = model.new_sequence_cache()
    rows = [model.prefill(torch.tensor(prompt), cache, 0)[-1]]
    for token in tokens[:-1]:
        rows.append(model.decode(torch.tensor([token]), [cache])[0])
    return tokens, [torch.log_softmax(row.double(), -1) for row in rows]


def test_chat_logprobs_in_openai_shape_equal_the_float64_oracle(client):
    whole = client.chat.completions.create(model="nano", messages=MESSAGES, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    tokens, wanted = oracle(6)
    assert len(content) == len(tokens)
    tokenizer = ByteTokenizer()
    for entry, token, want in zip(content, tokens, wanted, strict=True):
        assert bytes(entry.bytes) == tokenizer.token_bytes(token)
        assert entry.logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert len(entry.top_logprobs) == 3
        best = torch.sort(want, descending=True).values[:3].tolist()
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(best, abs=1e-4)
        assert entry.top_logprobs[0].bytes == entry.bytes  # greedy: the drawn token is the most likely
    # Streamed: the chunks' logprobs together are the whole completion's.
    stream = client.chat.completions.create(model="nano", messages=MESSAGES, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.bytes, round(e.logprob, 4)) for e in streamed] == [(e.bytes, round(e.logprob, 4)) for e in content]
    # Without logprobs the response has none.
    plain = client.chat.completions.create(model="nano", messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(("extra", "param"), [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                              ({"top_logprobs": 2}, "top_logprobs"),
                                              ({"logprobs": "yes"}, "logprobs")])
def test_bad_logprobs_values_are_openai_400s_naming_the_param(client, extra, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="nano", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert bad.value.status_code == 400 and bad.value.body["param"] == param
