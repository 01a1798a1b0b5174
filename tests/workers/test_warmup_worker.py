"""A decode worker process with the warm-up on (CPU: `--warmup on`, the decode fast path in its eager CPU
form so its bucket steps run too) beside one with it off, both real processes on loopback, registered in a
real etcd. Oracles: the warm-up's own log lines (health and membership are read before the log, so a
SERVING answer or an etcd record seen before "warm-up finished" was written fails), the cold worker and
k3core's offline generation (tokens), the hand count of the fast path's 2 scratch pages (pool usage), and
a prompt that was served (ProbePrefix finds it, so the probe of the warm-up's prompts could fail)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from k3.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from k3core.cache.hashing import chain_hashes
from services.engine.decode_fastpath import ENV as FASTPATH_ENV
from services.engine.params import GenerationOptions
from services.engine.warmup import warmup_tokens
from services.runtime.client import aio_channel
from services.runtime.ports import free_port
from services.runtime.registry import Watcher
from tests.support.metrics import scrape
from tests.support.processes import ServiceProcess
from tests.workers.client import decode_load, generate
from tests.workers.cluster import OVERRIDES, worker_args
from tests.workers.oracle import build_reference, offline_generate

HASH_BLOCK = 16
NUM_PAGES = 96
SCRATCH_PAGES = 2  # the decode fast path's padding-row pages (decode_fastpath.py), held for its lifetime
CLUSTER = "warmup-test"
# Its own etcd prefix: the session's etcd is shared, and a decode worker follows `<prefix>/weights/<model>`
# (weight_reload.py). Under the default "/k3" the warm worker served the nano weights test_trainer_service
# publishes there (version 2) whenever the full suite ran that test first: tokens unlike the cold worker's.
ETCD_PREFIX = "/k3-warmup-test"
ARGS = ["serve", "decode", "--metrics-port", "0", "--model", "nano", "--hash-block-tokens", str(HASH_BLOCK),
        "--step-token-budget", "128", "--num-pages", str(NUM_PAGES), "--max-running", "8", "--cluster", CLUSTER]


def log_entries(proc: ServiceProcess) -> list[dict]:
    return [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]


def logged(proc: ServiceProcess, message: str) -> bool:
    return any(entry.get("msg") == message for entry in log_entries(proc))


def health(stub: health_pb2_grpc.HealthStub) -> str:
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service="k3.v1.DecodeService"), timeout=0.5)
    except grpc.RpcError:
        return "DOWN"  # not listening yet
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def watch_start(proc: ServiceProcess, port: int, watcher: Watcher) -> list[tuple[str, bool, bool, bool]]:
    """Start `proc`, and until it is ready: (health, registered in etcd, "warm-up started" logged,
    "warm-up finished" logged), the log read last."""
    seen = []
    # reconnect at once: the channel's default back-off (1 s and growing) would skip the warm-up's window
    fast = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
            ("grpc.max_reconnect_backoff_ms", 50)]
    with ThreadPoolExecutor(1) as pool, grpc.insecure_channel(f"127.0.0.1:{port}", options=fast) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        started = pool.submit(proc.start, 180)
        while True:
            done = started.done()
            status = health(stub)
            registered = any(r.instance == "warm" and r.cluster == CLUSTER for r in watcher.snapshot().values())
            seen.append((status, registered, logged(proc, "warm-up started"), logged(proc, "warm-up finished")))
            if done:
                started.result()
                return seen
            time.sleep(0.01)


async def test_warm_worker_serves_only_after_its_warmup_and_leaves_no_trace(tmp_path: Path, etcd_server):
    port = free_port()
    env = {FASTPATH_ENV: "1"}
    warm = ServiceProcess([*ARGS, "--port", str(port), "--warmup", "on", "--instance", "warm",
                           "--etcd-endpoints", etcd_server, "--etcd-prefix", ETCD_PREFIX], tmp_path / "warm", env)
    cold = ServiceProcess([*ARGS, "--port", "0", "--warmup", "off", "--instance", "cold"], tmp_path / "cold", env)
    watcher = Watcher([etcd_server], ETCD_PREFIX)
    try:
        with ThreadPoolExecutor(1) as pool:
            cold_started = pool.submit(cold.start, 180)
            seen = watch_start(warm, port, watcher)
            cold_started.result()

        # NOT_SERVING (and unregistered) while the warm-up ran; SERVING or registered only after it finished
        assert any(s == ("NOT_SERVING", False, True, False) for s in seen), seen
        assert all(finished for status, registered, _, finished in seen if status == "SERVING" or registered)
        with grpc.insecure_channel(warm.address) as channel:
            assert health(health_pb2_grpc.HealthStub(channel)) == "SERVING"
        done = next(e for e in log_entries(warm) if e["msg"] == "warm-up finished")
        assert done["warmup_s"] > 0 and done["skipped"] == []
        assert done["prefill_chunks"] == [[9], [128, 9, 1], [2], [12]]  # + fast_prefill.WARMUP_ROWS
        assert done["decode_batches"] == [1, 2, 4, 8]
        assert logged(cold, "warm-up skipped") and not logged(cold, "warm-up started")
        assert scrape(warm.info["metrics_address"]).value("k3_decode_warmup_seconds", {"stage": "total"}) > 0
        assert scrape(cold.info["metrics_address"]).value("k3_decode_warmup_seconds", {"stage": "total"}) == 0
        # both serve the weights they started with (the cold worker follows no etcd), so tokens can compare
        assert scrape(warm.info["metrics_address"]).value("k3_decode_weights_version") == 0

        # the pool holds what an untouched one does: the fast path's scratch pages, nothing else
        usage = [(await decode_load(p.address)).pool_usage for p in (warm, cold)]
        assert usage == [SCRATCH_PAGES / NUM_PAGES] * 2

        # no prefix of the warm-up's prompts is cached
        vocab = build_reference().config.vocab_size
        for length in (9, 138):
            chain = chain_hashes(warmup_tokens(length, vocab), HASH_BLOCK)
            assert await probe(warm.address, chain) == 0

        # the first requests get the tokens a cold worker and the offline model give
        prompt = [(5 * j + 3) % 250 + 1 for j in range(48)]
        greedy = common_pb2.SamplingParams(max_tokens=6, ignore_eos=True)
        sampled = common_pb2.SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=6, ignore_eos=True)
        got = {(which, name): await tokens(p.address, f"{name}-1", prompt, params)
               for which, p in (("warm", warm), ("cold", cold))
               for name, params in (("greedy", greedy), ("sampled", sampled))}
        assert got["warm", "greedy"] == got["cold", "greedy"]
        assert got["warm", "sampled"] == got["cold", "sampled"]
        options = GenerationOptions.from_proto(greedy, vocab_size=vocab, max_tokens_limit=8192)
        assert got["warm", "greedy"] == offline_generate(build_reference(), prompt, options)
        # control: a served prompt's prefix is found by the same probe (how much: the cache's boundary rules)
        assert await probe(warm.address, chain_hashes(prompt, HASH_BLOCK)) >= HASH_BLOCK
    finally:
        watcher.close()
        warm.kill()
        cold.kill()


async def probe(address: str, chain: list[int]) -> int:
    async with aio_channel(address) as channel:
        reply = await decode_pb2_grpc.DecodeServiceStub(channel).ProbePrefix(
            decode_pb2.ProbePrefixRequest(block_hashes=chain, hash_block_tokens=HASH_BLOCK), timeout=10)
    return reply.hit_tokens


async def tokens(address: str, rid: str, prompt: list[int], sampling: common_pb2.SamplingParams) -> list[int]:
    return [t for chunk in await generate(address, rid, prompt, sampling) for t in chunk.token_ids]


async def test_tp2_prefill_worker_warms_up_on_both_ranks_and_computes_the_warmup_prompt_afresh(tmp_path: Path,
                                                                                                 transfer):
    """Both ranks run the warm-up's forwards before their start barrier (a rank that skipped or reordered
    one would leave the other blocked in a collective: the worker would never get ready)."""
    prefill = ServiceProcess(worker_args("prefill", 2, transfer.address, "--warmup", "on"), tmp_path / "prefill")
    try:
        prefill.start(180)
        done = next(e for e in log_entries(prefill) if e["msg"] == "warm-up finished")
        assert done["prefill_chunks"] == [[9], [64, 9]] and done["decode_batches"] == [] and done["skipped"] == []
        async with aio_channel(prefill.address) as channel:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            load = (await stub.GetPrefillLoad(prefill_pb2.GetPrefillLoadRequest(), timeout=10)).load
            assert load.pool_usage == 0
            model = build_reference("nano", OVERRIDES)
            prompt = warmup_tokens(73, model.config.vocab_size)  # the warm-up's long request, token for token
            reply = await stub.Prefill(prefill_pb2.PrefillRequest(
                request_id="after-warmup", prompt=common_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120)
        assert reply.cached_tokens == 0 and reply.prompt_tokens == 73
        options = GenerationOptions.from_proto(common_pb2.SamplingParams(max_tokens=1), vocab_size=model.config.vocab_size,
                                               max_tokens_limit=8192)
        assert [reply.first_token] == offline_generate(model, prompt, options)
    finally:
        prefill.kill()
