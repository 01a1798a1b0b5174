"""`k3 up / status / down` for real: a one-cluster fleet of real processes on loopback (etcd, admission,
router, gateway, kvtransfer, prefill, decode), driven through the CLI as a subprocess; requests through
the front door checked against the offline model; the official `openai` client streams from it."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import aiohttp
import grpc
import openai
import pytest

from k3.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from k3core.tokenizer import ByteTokenizer
from services.admission.cost_model import CostModel
from services.cli import fleet
from tests.fleet.k3cli import k3, logs, running_fleet, state

# The workers (and their offline oracle) land separately; without them there is no fleet to test.
GenerationOptions = pytest.importorskip("services.engine.params").GenerationOptions
oracle = pytest.importorskip("tests.workers.oracle")

SERVICES = {"admission", "router", "gateway", "kvtransfer", "decode", "prefill"}


@pytest.fixture(scope="module")
def local_fleet(tmp_path_factory):
    home = tmp_path_factory.mktemp("k3home")
    with running_fleet(home, "--clusters", "1", "--lease-ttl-s", "2") as started:
        yield home, started, state(home)


def member(fleet_state: fleet.FleetState, service: str) -> fleet.Member:
    return next(m for m in fleet_state.members if m.service == service)


def test_up_starts_every_service_and_the_smoke_request_succeeds(local_fleet):
    home, started, fleet_state = local_fleet
    assert {m.service for m in fleet_state.members} == SERVICES
    assert all(fleet.alive(m.pid) for m in fleet_state.members) and fleet.alive(fleet_state.etcd_pid)
    # Every member is listed SERVING, and the smoke chat completion went through cluster c0.
    for m in fleet_state.members:
        assert re.search(rf"^{m.service}\s+{m.cluster}\s+{m.pid}\s+{re.escape(m.address)}\s+SERVING", started.stdout,
                         re.M), started.stdout
    assert re.search(r"smoke: POST /v1/chat/completions -> (length|stop), \d+ tokens from cluster c0",
                     started.stdout), started.stdout + logs(home)
    # The router sees the cluster through etcd membership: healthy, with one instance of each worker.
    with grpc.insecure_channel(member(fleet_state, "router").address) as channel:
        view = router_pb2_grpc.RouterServiceStub(channel).GetFleet(router_pb2.GetFleetRequest(), timeout=5)
    (cluster,) = view.clusters
    assert cluster.cluster.name == "c0" and cluster.healthy
    assert sorted(i.service for i in cluster.instances) == ["decode", "kvtransfer", "prefill"]


def test_status_shows_health_and_key_metrics(local_fleet):
    home, _, fleet_state = local_fleet
    shown = k3(home, "status", timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = {line.split()[0]: line for line in shown.stdout.splitlines() if line.split()}
    assert "(up)" in lines["etcd"] and lines["clusters"].split()[1:] == ["c0", "healthy"]
    for m in fleet_state.members:
        assert "SERVING" in lines[m.service] and "registry_connected=1" in lines[m.service], shown.stdout
    assert "decode_running=" in lines["decode"] and "decode_pool_usage=" in lines["decode"]
    assert "router_healthy_clusters=1" in lines["router"]
    # The smoke request (at least) went through the gateway.
    assert float(re.search(r"gateway_requests_total=(\S+)", lines["gateway"]).group(1)) >= 1


def test_tokens_through_the_fleet_equal_the_offline_model(local_fleet):
    """gateway (gRPC) -> router -> admission -> prefill -> kvtransfer -> decode, greedy, against k3core's model
    run offline on a contiguous cache (the workers' seeded weights, no pool, no transfer)."""
    _, _, fleet_state = local_fleet
    prompt = "The fleet answers: "
    sampling = common_pb2.SamplingParams(temperature=0, top_p=1.0, max_tokens=8)

    async def complete() -> list[int]:
        async with grpc.aio.insecure_channel(member(fleet_state, "gateway").address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            tokens, clusters = [], set()
            async for reply in stub.Complete(gateway_pb2.CompleteRequest(
                    model="nano", prompt=prompt, sampling=sampling,
                    session=common_pb2.SessionRef(session_id="oracle")), timeout=120):
                tokens.extend(reply.chunk.token_ids)
                clusters.add(reply.cluster)
            assert clusters == {"c0"}
            return tokens

    got = asyncio.run(complete())
    reference = oracle.build_reference("nano")
    options = GenerationOptions.from_proto(sampling, vocab_size=reference.config.vocab_size, max_tokens_limit=100)
    assert got == oracle.offline_generate(reference, ByteTokenizer().encode(prompt), options)


def test_openai_client_streams_a_chat_completion(local_fleet):
    _, _, fleet_state = local_fleet
    client = openai.OpenAI(base_url=f"http://{member(fleet_state, 'gateway').extra['http_address']}/v1",
                           api_key="local-fleet-has-no-auth", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["nano"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Stream to me."}]
    stream = client.chat.completions.create(model="nano", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("length", "stop")
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices and 1 <= usage.completion_tokens <= 6
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert {c.system_fingerprint for c in chunks if c.choices} == {"k3:c0"}
    # Greedy decoding: the stream and a whole (non-streamed) completion of the same conversation agree.
    whole = client.chat.completions.create(model="nano", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.content == content
    assert whole.usage.completion_tokens == usage.completion_tokens
    # Bad input: OpenAI-format errors that the official client maps to its exception types.
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="nano", messages=messages, max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"


def test_admission_gets_the_prefill_cost_back_at_the_first_token_and_the_rest_at_the_end(local_fleet):
    """The gateway holds a ticket's decode part while streaming and nothing once the request is done."""
    _, _, fleet_state = local_fleet
    http = member(fleet_state, "gateway").extra["http_address"]
    prompt, max_tokens = "count slowly: one two three", 256
    # Costs are whole units (GPU-ms rounded up), so admitting and releasing balance exactly.
    decode_cost = math.ceil(CostModel.k3_h200().decode(len(ByteTokenizer().encode(prompt)), max_tokens))

    def in_use() -> float:
        with grpc.insecure_channel(member(fleet_state, "admission").address) as channel:
            reply = admission_pb2_grpc.AdmissionServiceStub(channel).GetBudgets(
                admission_pb2.GetBudgetsRequest(cluster="c0"), timeout=5)
        return sum(b.in_use for b in reply.budgets)

    async def stream() -> tuple[float, float]:
        body = {"model": "nano", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{http}/v1/completions", json=body) as reply:
                assert reply.status == 200
                await reply.content.readline()  # the first token's chunk
                during = await asyncio.to_thread(in_use)
                async for _ in reply.content:
                    pass
        return during, await asyncio.to_thread(in_use)

    during, after = asyncio.run(stream())
    assert during == decode_cost
    assert after == 0


def decode_instances(fleet_state: fleet.FleetState) -> list[str]:
    with grpc.insecure_channel(member(fleet_state, "router").address) as channel:
        view = router_pb2_grpc.RouterServiceStub(channel).GetFleet(router_pb2.GetFleetRequest(), timeout=5)
    return sorted(i.instance for c in view.clusters for i in c.instances if i.service == "decode")


def test_scale_decode_out_and_back_in(local_fleet):
    home, _, fleet_state = local_fleet
    out = k3(home, "scale", "decode=2", "--cluster", "c0", timeout=120)
    assert out.returncode == 0 and "started decode-c0-1" in out.stdout, out.stdout + out.stderr
    deadline = time.monotonic() + 10
    while decode_instances(fleet_state) != ["decode-c0-0", "decode-c0-1"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert decode_instances(fleet_state) == ["decode-c0-0", "decode-c0-1"]
    added = next(m for m in state(home).members if m.name == "decode-c0-1")
    back = k3(home, "scale", "decode=1", "--cluster", "c0", timeout=60)
    assert back.returncode == 0 and "drained decode-c0-1" in back.stdout
    # Drained, not killed: its lease was revoked on the way out, so the router forgets it at once.
    assert not fleet.alive(added.pid) and decode_instances(fleet_state) == ["decode-c0-0"]
    assert [m.name for m in state(home).members if m.service == "decode"] == ["decode-c0-0"]
    assert k3(home, "scale", "decode=x", timeout=30).returncode == 2


def test_down_drains_every_process(local_fleet):
    home, _, fleet_state = local_fleet
    stopped = k3(home, "down", timeout=60)
    assert stopped.returncode == 0 and f"stopped {len(fleet_state.members)} processes" in stopped.stdout
    assert not any(fleet.alive(m.pid) for m in fleet_state.members) and not fleet.alive(fleet_state.etcd_pid)
    assert not (home / "fleet.json").exists()
    for m in fleet_state.members:
        # Each member drained (SIGTERM: NOT_SERVING, lease revoked, in-flight calls finished), none was killed.
        events = [json.loads(line)["msg"] for line in (home / "logs" / f"{m.name}.log").read_text().splitlines()
                  if line.startswith("{")]
        assert "draining" in events and events[-1] == "stopped", (m.name, events[-3:])
    assert k3(home, "status", timeout=30).returncode == 1
