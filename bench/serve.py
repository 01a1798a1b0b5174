"""Decode throughput and TTFT of the worker engine, against the decode step's memory roofline.

    python bench/serve.py [--model mini] [--device cuda] [--batches 1 16 64 256] [--context 512]
                          [--prefix 16384] [--increment 512] [--out bench/results/serve.json]

Runs the decode worker's engine in-process (scheduler, paged pool, executor, model; TP 1, no gRPC) on
seeded random weights:
- decode: B requests of `--context` prompt tokens are prefilled, then `--steps` decode steps are timed.
  The roofline of one step is (weight bytes touched + KDA state read+write + MLA latent read) over the copy
  bandwidth measured in the same run; the ratio is achieved bytes/s over that bandwidth.
- TTFT: a `--prefix`-token prompt uncached, then a new request sharing that prefix plus `--increment`
  tokens, which restores from the prefix cache (MLA blocks + KDA checkpoint) and prefills only the rest.
- peer: Hugging Face transformers' `kimi_linear` model in the Kimi-Linear form of the preset
  (`<model>-kl`), batch-1 decode, when the image has it; otherwise the reason is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from k3.v1 import common_pb2
from k3core.cache.manager import PrefixCacheManager
from k3core.model import K3Model
from services.engine.config import WorkerConfig
from services.engine.executor import Executor
from services.engine.model_runner import ModelRunner
from services.engine.params import GenerationOptions
from services.engine.plan import RecordingManager
from services.engine.request import EngineRequest
from services.engine.sampler import sample_next
from services.engine.scheduler import Scheduler


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    started, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - started)


@torch.no_grad()
def random_model(config, device: str, dtype: torch.dtype) -> K3Model:
    """Seeded random weights drawn on the device (a 2.4B-parameter CPU init would dominate the run)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = K3Model(config)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            param.fill_(1.0)
        elif name.endswith("A_log") or name.endswith("e_score_correction_bias"):
            param.zero_()
        else:
            param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
    return model.to(dtype).eval()


class Bench:
    def __init__(self, config: WorkerConfig, model: K3Model):
        self.config = config
        manager = PrefixCacheManager(config.pool_layout(), config.num_pages, device=config.device)
        self.executor = Executor(manager, ModelRunner(model, config.device), rank=0, tp_size=1,
                                 total_heads=model.config.kda_num_heads, instance=common_pb2.InstanceId())
        self.recording = RecordingManager(manager)
        self.scheduler = Scheduler(self.recording, hash_block_tokens=config.hash_block_tokens,
                                   max_running=config.max_running, step_token_budget=config.step_token_budget,
                                   model_name=config.model)
        self.options = GenerationOptions.from_proto(common_pb2.SamplingParams(max_tokens=100_000, ignore_eos=True),
                                                    vocab_size=model.config.vocab_size, max_tokens_limit=100_000)
        self.requests: dict[str, EngineRequest] = {}
        self.token_range = min(1000, model.config.vocab_size - 2)

    def submit(self, rid: str, prompt: list[int]) -> EngineRequest:
        req = EngineRequest(rid, prompt, self.options, lambda out: None)
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def step(self) -> list[str]:
        """One engine step; returns the requests that got a token."""
        plan = self.scheduler.schedule()
        result = self.executor.execute(plan)
        sampled = [f.rid for f in plan.forward if f.sample]
        for row, rid in enumerate(sampled):
            req = self.requests[rid]
            token = sample_next(result.logits[row], self.options, len(req.output))
            req.output.append(token)
            self.recording.call("append_tokens", rid, [token])
        return sampled

    def finish_all(self) -> None:
        for req in list(self.requests.values()):
            self.scheduler.remove(req, keep_turn=True)
        self.requests.clear()
        self.step()


def step_bytes(model: K3Model, batch: int, context: int) -> int:
    """Bytes one decode step must move at minimum: weights touched, KDA state read+write, MLA latents."""
    c = model.config
    expert_bytes = experts = 0
    total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert_bytes += nbytes
            experts += 1
        elif "embed_tokens" not in name:
            total += nbytes
    if experts:
        per_expert = expert_bytes / (experts / 3)  # w1, w2, w3 per expert
        moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        touched = min(c.num_experts, batch * c.num_experts_per_token)
        total += int(moe_layers * touched * per_expert)
    heads, d, w = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
    state = len(c.kda_layers) * heads * (d * d * 4 + 3 * d * (w - 1) * 2)
    latent = len(c.mla_layers) * c.mla_latent_dim * 2 * context
    return total + batch * (2 * state + latent)


def decode_throughput(bench: Bench, batch: int, context: int, steps: int, device: str) -> float:
    """Seconds per decode step with `batch` running requests at about `context` tokens."""
    for i in range(batch):
        bench.submit(f"d{batch}-{i}", [(17 * i + j) % bench.token_range + 1 for j in range(context)])
    while any(not r.output for r in bench.requests.values()):
        bench.step()
    bench.step()  # warm the pure decode path
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        bench.step()
    sync(device)
    elapsed = (time.perf_counter() - started) / steps
    bench.finish_all()
    return elapsed


def time_to_first_token(bench: Bench, prompt: list[int], rid: str, device: str) -> tuple[float, int]:
    sync(device)
    started = time.perf_counter()
    req = bench.submit(rid, prompt)
    while not req.output:
        bench.step()
    sync(device)
    elapsed = time.perf_counter() - started
    cached = req.cached_tokens
    bench.finish_all()
    return elapsed, cached


def hf_peer(model_name: str, device: str, steps: int) -> dict:
    """Batch-1 decode of transformers' kimi_linear on the Kimi-Linear form of the preset, if present."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
        from transformers.models import kimi_linear  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        from k3core.presets import preset
        hf_dict = preset(f"{model_name}-kl").to_hf_dict()
        config = AutoConfig.for_model("kimi_linear", **{k: v for k, v in hf_dict.items() if k != "model_type"})
        with torch.device(device):
            peer = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
        ids = torch.arange(1, 513, device=device)[None]
        with torch.no_grad():
            out = peer(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync(device)
            started = time.perf_counter()
            for _ in range(steps):
                out = peer(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync(device)
        return {"available": True, "step_s": (time.perf_counter() - started) / steps}
    except Exception as exc:  # noqa: BLE001
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--increment", type=int, default=512)
    parser.add_argument("--num-pages", type=int, default=1200)
    parser.add_argument("--hash-block", type=int, default=512)
    parser.add_argument("--out", default="bench/results/serve.json")
    args = parser.parse_args()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    config = WorkerConfig.load("decode", ["--model", args.model, "--device", args.device, "--dtype", dtype,
                                          "--num-pages", str(args.num_pages), "--max-running", "512",
                                          "--step-token-budget", "8192", "--hash-block-tokens", str(args.hash_block),
                                          "--torch-threads", "0"], env={})
    bandwidth = copy_bandwidth(args.device, (1 << 30) if args.device.startswith("cuda") else (1 << 26))
    model = random_model(config.model_config(), args.device, config.torch_dtype)
    bench = Bench(config, model)
    header = {"model": args.model, "device": args.device, "dtype": dtype, "copy_bandwidth_Bps": bandwidth,
              "context": args.context}
    rows = []
    print(f"model {args.model} on {args.device} ({dtype}); copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'batch':>6} {'step ms':>9} {'tok/s':>10} {'roofline ms':>12} {'of roofline':>12}")
    for batch in args.batches:
        step_s = decode_throughput(bench, batch, args.context, args.steps, args.device)
        roof_s = step_bytes(model, batch, args.context) / bandwidth
        rows.append({"batch": batch, "step_s": step_s, "tokens_per_s": batch / step_s, "roofline_step_s": roof_s,
                     "fraction_of_roofline": roof_s / step_s})
        print(f"{batch:>6} {1e3 * step_s:>9.2f} {batch / step_s:>10.1f} {1e3 * roof_s:>12.3f} {roof_s / step_s:>11.1%}")
        save(args.out, {**header, "decode": rows, "complete": False})  # a partial run keeps what it measured
    # A miss: a fresh prefix + increment. A hit: the same-length prompt whose prefix an earlier turn left in
    # the cache (its prompt-end KDA checkpoint is kept, as a conversation's turn boundary is).
    fresh = [(11 * j) % bench.token_range + 1 for j in range(args.prefix)]
    uncached, _ = time_to_first_token(bench, fresh + [5] * args.increment, "ttft-miss", args.device)
    prefix = [(7 * j) % bench.token_range + 1 for j in range(args.prefix)]
    time_to_first_token(bench, prefix, "ttft-turn1", args.device)
    cached, hit = time_to_first_token(bench, prefix + [9] * args.increment, "ttft-hit", args.device)
    print(f"TTFT {args.prefix}+{args.increment} tokens: uncached {uncached:.3f} s, prefix hit ({hit} tokens) "
          f"{cached:.3f} s, ratio {uncached / cached:.1f}x")
    peer = hf_peer(args.model, args.device, args.steps)
    if peer.get("available"):
        ours = rows[0]["step_s"]
        print(f"peer transformers kimi_linear ({args.model}-kl) batch 1: {1e3 * peer['step_s']:.2f} ms/step; "
              f"ours / peer speed {peer['step_s'] / ours:.2f}x")
    else:
        print(f"peer transformers kimi_linear: not run ({peer['reason']})")
    save(args.out, {**header, "decode": rows, "complete": True,
                    "ttft": {"prefix": args.prefix, "increment": args.increment, "uncached_s": uncached,
                             "cached_s": cached, "hit_tokens": hit},
                    "peer_kimi_linear": peer})


def save(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
