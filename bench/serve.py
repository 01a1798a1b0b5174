"""Decode throughput and TTFT of one engine rank, against the decode step's memory roofline and a named peer.

    python -m bench.serve [--model mini] [--batches 1 16 64 256] [--contexts 1024 4096] [--steps 10]
                          [--prefix 32768] [--increment 512] [--peer-batches 1 16] [--time-limit 420]

Runs one TP-1 rank in-process on seeded random weights: the paged pool (`k3core.cache`), the reference
layers for prefill (`ModelRunner`), and the decode fast path the executor uses on CUDA (`DecodeFastPath`:
kernels through `kernels.dispatch` on the pool's pages, one CUDA graph per batch bucket). It drives the
cache manager with the calls the engine's executor makes (append, reserve, pre_forward, forward,
forward_done, commit_step); the scheduler and gRPC layers are left out (they import the service runtime,
which the accelerator image lacks). Greedy sampling of the whole batch is one argmax and one host copy.
- decode: B requests at `context` tokens (pages reserved and marked computed without a prefill forward:
  the cost of a decode step does not depend on the cached values), `--steps` timed steps after warm-up.
  Roofline of a step = (weights touched + KDA state read and write + MLA latent read) / copy bandwidth
  measured in the same run.
- TTFT: a fresh `--prefix` + `--increment` prompt (uncached), then the same prefix with a different
  increment (restored from the prefix cache: MLA blocks + the KDA checkpoint at the prefix end).
- peer: Hugging Face transformers' `kimi_linear` model on the Kimi-Linear form of the preset (`<model>-kl`)
  with the same weights (our state dict loaded into it), decode at the same batch and context; ours runs
  the same `-kl` model. Greedy tokens of both on one prompt are compared as a check.
Rows are written to `--out` as they are measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from k3core.cache.checkpoints import CheckpointPolicy
from k3core.cache.layout import plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.config import K3Config
from k3core.model import K3Model
from k3core.presets import preset
from services.engine import fast_ffn
from services.engine.decode_fastpath import DecodeFastPath
from services.engine.model_runner import ModelRunner


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    started, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    sync()
    return 2 * nbytes * reps / (time.perf_counter() - started)


@torch.no_grad()
def random_model(config: K3Config, device: str, dtype: torch.dtype) -> K3Model:
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


class ForwardTimer:
    """Device time of the forward (CUDA events), or wall time on the CPU."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.began = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        self.ended = time.perf_counter()

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3 if self.cuda else self.ended - self.began


class Rank:
    """One TP-1 engine rank: pool, reference prefill, decode fast path (on CUDA), greedy sampling."""

    def __init__(self, model: K3Model, name: str, args: argparse.Namespace, dtype: torch.dtype):
        layout = plan_layout(shape_from_config(model.config, name), 1, state_dtype=torch.float32, conv_dtype=dtype,
                             mla_dtype=dtype, hash_block_tokens=args.hash_block)
        # Every chunk end keeps its checkpoint (no supersede), so a later prompt sharing the prefix finds one.
        self.manager = PrefixCacheManager(layout, args.num_pages, policy=CheckpointPolicy(supersede=False),
                                          device=args.device)
        max_len = args.prefix + args.increment + args.steps + 64
        self.runner = ModelRunner(model, args.device, max_model_len=max_len, max_batch=max(args.batches))
        self.fast = self.runner.decode_fastpath(self.manager, tp_size=1)
        self.budget = args.budget
        self.vocab = min(997, model.config.vocab_size - 2)  # token ids 1..vocab in every prompt here
        self.forward_s: list[float] = []

    def prefill(self, rid: str, tokens: list[int]) -> tuple[int, int]:
        """Admit and prefill a prompt in hash-aligned chunks; (first token, prompt tokens served by the cache)."""
        manager = self.manager
        hit = manager.add_request(rid, tokens)
        req = manager.requests[rid]
        while req.num_computed < len(tokens):
            n = manager.prefill_chunk(rid, self.budget)
            manager.reserve(rid, n)
            manager.pre_forward()
            start = req.num_computed
            logits = self.runner.forward([tokens[start : start + n]], manager.batch_view([rid]))
            manager.forward_done(rid)
            manager.commit_step()
        self.last_logits = logits[-1]
        return int(logits[-1].argmax()), hit

    def fill(self, rids: list[str], context: int) -> None:
        """Requests at `context` tokens without a forward (pages reserved, marked computed)."""
        manager = self.manager
        for i, rid in enumerate(rids):
            hit = manager.add_request(rid, [(7919 * i + 31 * j + context) % self.vocab + 1 for j in range(context)])
            manager.reserve(rid, context - hit)
        manager.pre_forward()
        for rid in rids:
            manager.forward_done(rid)
        manager.commit_step()

    def next_tokens(self, batch: int, step: int) -> list[int]:
        """The tokens fed back: one pseudo-random id per row and step. (The greedy argmax of random weights
        is the same token for every row, so every row would route to the same few experts; a trained
        model's batch spreads over them, which is what the roofline assumes.)"""
        return [(104729 * (step + 1) + 7919 * row) % self.vocab + 1 for row in range(batch)]

    def decode(self, rids: list[str], tokens: list[int]) -> list[int]:
        manager = self.manager
        for rid, token in zip(rids, tokens, strict=True):
            manager.append_tokens(rid, [token])
            manager.reserve(rid, 1)
        manager.pre_forward()
        cached = [manager.requests[r] for r in rids]
        timer = ForwardTimer()
        if self.fast is not None and self.fast.supports(cached):
            logits = self.fast.forward(cached, tokens)
        else:
            logits = self.runner.forward([[t] for t in tokens], manager.batch_view(rids))
        timer.stop()
        next_tokens = logits.argmax(-1).tolist()
        self.forward_s.append(timer.seconds())
        for rid in rids:
            manager.forward_done(rid)
        manager.commit_step()
        return next_tokens

    def finish(self, rids: list[str], keep_turn: bool = False) -> None:
        for rid in rids:
            self.manager.finish(rid, keep_turn)


def step_bytes(model: K3Model, batch: int, context: int) -> int:
    """Bytes one decode step must move at minimum: weights touched, KDA state read+write, MLA latents."""
    c = model.config
    expert_bytes = experts = total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert_bytes, experts = expert_bytes + nbytes, experts + 1
        elif "embed_tokens" not in name:
            total += nbytes
    if experts:
        per_expert = expert_bytes / (experts / 3)  # w1, w2, w3 per expert
        moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        total += int(moe_layers * min(c.num_experts, batch * c.num_experts_per_token) * per_expert)
    heads, d, w = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
    state = len(c.kda_layers) * heads * (d * d * 4 + 3 * d * (w - 1) * 2)
    latent = len(c.mla_layers) * c.mla_latent_dim * 2 * context
    return total + batch * (2 * state + latent)


def decode_row(rank: Rank, batch: int, context: int, steps: int, tag: str) -> tuple[float, float]:
    """(wall seconds per step, forward seconds per step) of `batch` requests at `context` tokens."""
    rids = [f"{tag}-{batch}-{context}-{i}" for i in range(batch)]
    rank.fill(rids, context)
    for step in range(3):  # captures this bucket's graph, then warm
        rank.decode(rids, rank.next_tokens(batch, step))
    sync()
    rank.forward_s.clear()
    started = time.perf_counter()
    for step in range(steps):
        rank.decode(rids, rank.next_tokens(batch, step))  # samples (argmax), feeds the row's next token
    sync()
    wall = (time.perf_counter() - started) / steps
    forward = sorted(rank.forward_s)[len(rank.forward_s) // 2]
    rank.finish(rids)
    return wall, forward


def profile_forward(rank: Rank, batch: int, context: int) -> None:
    """Kernel time by name of one eager fast-path forward (printed): where the step's device time goes."""
    from torch.profiler import ProfilerActivity, profile

    rids = [f"prof-{i}" for i in range(batch)]
    rank.fill(rids, context)
    tokens = rank.next_tokens(batch, 0)
    for rid, token in zip(rids, tokens, strict=True):
        rank.manager.append_tokens(rid, [token])
        rank.manager.reserve(rid, 1)
    fast = rank.fast
    cached = [rank.manager.requests[r] for r in rids]
    inputs = fast.builder.view(torch.from_numpy(fast.builder.build(cached, tokens, batch)).to(fast.device), batch)
    touched: list[int] = []
    route = fast_ffn.sigmoid_router

    def counting_router(*a, **k):
        weights, indices = route(*a, **k)
        touched.append(int(indices.unique().numel()))
        return weights, indices

    fast_ffn.sigmoid_router = counting_router  # eager only: count the experts each MoE layer reads
    fast.decoder.forward(inputs)
    fast_ffn.sigmoid_router = route
    print(f"experts touched per MoE layer at batch {batch}: {touched}")
    sync()
    with profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]) as prof:
        fast.decoder.forward(inputs)
        sync()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events)
    print(f"profile batch {batch} ctx {context}: {sum(e.count for e in events)} kernels, {total / 1e3:.2f} ms device")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:22]:
        print(f"  {e.device_time_total / 1e3:7.3f} ms {e.count:5d}x  {e.key[:90]}")
    for rid in rids:
        rank.manager.forward_done(rid)
    rank.manager.commit_step()
    rank.finish(rids)


def check_fast_path(rank: Rank, batch: int = 4, prompt_len: int = 96) -> dict:
    """One decode step through the fast path and through the reference layers from the same pool bytes
    (really prefilled prompts): logits and written KDA pages apart by how much. Variants localise a gap:
    the graph as served, eager with side streams, eager on one stream, eager with dense MoE, and eager
    with the kernels' references (K3_KERNELS_REFERENCE=1)."""
    manager, store = rank.manager, rank.manager.store
    rids = [f"check-{i}" for i in range(batch)]
    for i, rid in enumerate(rids):
        rank.prefill(rid, [(17 * i + 5 * j) % rank.vocab + 1 for j in range(prompt_len + 7 * i)])
    tokens = rank.next_tokens(batch, 0)
    for rid, token in zip(rids, tokens, strict=True):
        manager.append_tokens(rid, [token])
        manager.reserve(rid, 1)
    manager.pre_forward()
    cached = [manager.requests[r] for r in rids]
    state_pages = sorted(p for r in cached for p in r.state_pages)
    pages = sorted(set(state_pages) | {p for r in cached for b in r.blocks for p in b.pages})
    before = store.data[pages].clone()

    def run(forward) -> tuple[torch.Tensor, torch.Tensor]:
        store.data[pages] = before
        logits = forward().float().clone()
        return logits, store.data[state_pages].view(torch.float32).clone()

    eager = DecodeFastPath(rank.runner.model, manager, max_model_len=rank.runner.max_model_len, graphs=False)
    one_stream = DecodeFastPath(rank.runner.model, manager, max_model_len=rank.runner.max_model_len, graphs=False)

    def dense() -> torch.Tensor:
        for op in one_stream.decoder.ffn:
            op.grouped = False
        return one_stream.forward(cached, tokens)

    def references() -> torch.Tensor:
        os.environ["K3_KERNELS_REFERENCE"] = "1"
        try:
            return one_stream.forward(cached, tokens)
        finally:
            del os.environ["K3_KERNELS_REFERENCE"]

    variants = {"graph": lambda: rank.fast.forward(cached, tokens), "eager": lambda: eager.forward(cached, tokens),
                "one_stream": lambda: one_stream.forward(cached, tokens), "dense_moe": dense,
                "kernel_references": references}
    outs = {name: run(fn) for name, fn in variants.items()}
    ref_logits, ref_states = run(lambda: rank.runner.forward([[t] for t in tokens], manager.batch_view(rids)))
    result = {"batch": batch, "logits_std": float(ref_logits.std()), "state_page_max_abs": float(ref_states.abs().max())}
    for name, (logits, states) in outs.items():
        result[name] = {"logits_max_abs_diff": float((logits - ref_logits).abs().max()),
                        "argmax_equal": f"{int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())}/{batch}",
                        "state_page_max_abs_diff": float((states - ref_states).abs().max())}
        print(f"fast path ({name}) vs reference, one step at batch {batch}: {result[name]}")
    for rid in rids:
        manager.forward_done(rid)
    manager.commit_step()
    rank.finish(rids)
    return result


def ttft(rank: Rank, prefix: list[int], increment: int) -> dict:
    rank.prefill("warm", [(t * 5) % rank.vocab + 1 for t in prefix[:2048]])  # warm kernels and allocator, no shared prefix
    rank.finish(["warm"])
    rank.budget = math.gcd(rank.budget, len(prefix))  # a forward ends at the prefix: its checkpoint is kept
    sync()
    started = time.perf_counter()
    rank.prefill("miss", prefix + [5] * increment)
    sync()
    uncached = time.perf_counter() - started
    rank.finish(["miss"], keep_turn=True)
    started = time.perf_counter()
    _, hit = rank.prefill("hit", prefix + [9] * increment)
    sync()
    cached = time.perf_counter() - started
    rank.finish(["hit"])
    return {"prefix": len(prefix), "increment": increment, "uncached_s": uncached, "cached_s": cached,
            "hit_tokens": hit, "speedup": uncached / cached}


def hf_peer(ours: K3Model, rank: Rank, args: argparse.Namespace, name: str) -> dict:
    """transformers' kimi_linear with our weights vs our rank on the same `-kl` model."""
    try:
        from transformers import AutoModelForCausalLM
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    from safetensors.torch import save_file

    # Our checkpoint in the released Kimi Linear layout; transformers converts its names on load.
    folder = Path(tempfile.mkdtemp(prefix="k3-peer-"))
    save_file({k: v.detach().cpu().contiguous() for k, v in ours.state_dict().items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**ours.config.to_hf_dict(), "torch_dtype": "bfloat16"}))
    peer, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True)
    peer = peer.to(args.device).eval()
    shutil.rmtree(folder, ignore_errors=True)
    result = {"available": True, "model": name, "transformers_class": type(peer).__name__,
              "same_weights": not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")),
              "loading_info": {k: [str(x) for x in list(v)[:6]] for k, v in info.items() if v}}
    prompt = [(11 * j) % rank.vocab + 1 for j in range(64)]
    with torch.no_grad():
        hf_logits = peer(torch.tensor([prompt], device=args.device)).logits[0, -1].float()
        hf_tokens = peer.generate(torch.tensor([prompt], device=args.device), max_new_tokens=8, do_sample=False)
    first, _ = rank.prefill("check", prompt)
    ours_logits = rank.last_logits.float()
    result["prompt_logits_max_abs_diff"] = float((hf_logits - ours_logits).abs().max())
    result["prompt_logits_std"] = float(ours_logits.std())
    ours_tokens = [first]
    for _ in range(7):
        ours_tokens += rank.decode(["check"], ours_tokens[-1:])
    rank.finish(["check"])
    result["greedy_tokens_equal"] = f"{sum(a == b for a, b in zip(hf_tokens[0, 64:].tolist(), ours_tokens, strict=False))}/8"
    rows = []
    for batch in args.peer_batches:
        ids = torch.tensor([[(7 * i + j) % rank.vocab + 1 for j in range(args.peer_context)] for i in range(batch)],
                           device=args.device)
        with torch.no_grad():
            out = peer(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync()
            started = time.perf_counter()
            for step in range(args.peer_steps):  # sample (argmax), feed the same tokens our rank gets
                out = peer(token, past_key_values=past, use_cache=True)
                past, _ = out.past_key_values, out.logits[:, -1:].argmax(-1)
                token = torch.tensor(rank.next_tokens(batch, step), device=args.device)[:, None]
            sync()
        peer_s = (time.perf_counter() - started) / args.peer_steps
        ours_s, _ = decode_row(rank, batch, args.peer_context, args.peer_steps, "peer")
        rows.append({"batch": batch, "context": args.peer_context, "peer_step_s": peer_s, "ours_step_s": ours_s,
                     "speedup": peer_s / ours_s})
        print(f"peer kimi_linear ({name}) batch {batch} ctx {args.peer_context}: {1e3 * peer_s:.2f} ms/step, "
              f"ours {1e3 * ours_s:.2f} ms/step: {peer_s / ours_s:.1f}x")
    result["rows"] = rows
    del peer
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mini")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--increment", type=int, default=512)
    parser.add_argument("--peer-batches", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--peer-context", type=int, default=1024)
    parser.add_argument("--peer-steps", type=int, default=5)
    parser.add_argument("--num-pages", type=int, default=16000)
    parser.add_argument("--hash-block", type=int, default=512)
    parser.add_argument("--budget", type=int, default=8192, help="prefill tokens per forward")
    parser.add_argument("--check", action="store_true", help="compare one fast-path step with the reference")
    parser.add_argument("--profile", type=int, default=0, help="print the kernel profile at this batch size")
    parser.add_argument("--time-limit", type=float, default=420.0, help="skip what would start after this")
    parser.add_argument("--out", default="bench/results/serve.json")
    args = parser.parse_args()
    began = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    bandwidth = copy_bandwidth(args.device, (1 << 30) if args.device.startswith("cuda") else (1 << 26))
    model = random_model(preset(args.model), args.device, dtype)
    rank = Rank(model, args.model, args, dtype)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result: dict = {"model": args.model, "device": f"{device_name}, torch {torch.__version__}", "dtype": str(dtype),
                    "copy_bandwidth_Bps": bandwidth, "fast_path": rank.fast is not None,
                    "cuda_graphs": bool(rank.fast and rank.fast.graphs), "decode": [], "skipped": []}
    print(f"model {args.model} on {device_name} ({dtype}); copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
          f"fast path {result['fast_path']}, graphs {result['cuda_graphs']}")
    print(f"{'batch':>6} {'context':>8} {'step ms':>9} {'fwd ms':>8} {'tok/s':>9} {'roofline ms':>12} {'of roof':>8}")
    if args.check and rank.fast is not None:
        result["fast_path_check"] = check_fast_path(rank)
    if args.profile and rank.fast is not None:
        profile_forward(rank, args.profile, args.contexts[0])
    for context in args.contexts:
        for batch in args.batches:
            if time.perf_counter() - began > args.time_limit:
                result["skipped"].append(f"decode batch {batch} context {context}")
                continue
            wall, forward = decode_row(rank, batch, context, args.steps, "d")
            roof = step_bytes(model, batch, context) / bandwidth
            result["decode"].append({"batch": batch, "context": context, "step_s": wall, "forward_s": forward,
                                     "tokens_per_s": batch / wall, "roofline_step_s": roof,
                                     "fraction_of_roofline": roof / wall, "forward_fraction_of_roofline": roof / forward})
            print(f"{batch:>6} {context:>8} {1e3 * wall:>9.2f} {1e3 * forward:>8.2f} {batch / wall:>9.1f} "
                  f"{1e3 * roof:>12.3f} {roof / wall:>8.1%}", flush=True)
            save(args.out, result)
    if time.perf_counter() - began < args.time_limit and args.prefix:
        result["ttft"] = ttft(rank, [(11 * j) % rank.vocab + 1 for j in range(args.prefix)], args.increment)
        t = result["ttft"]
        print(f"TTFT {args.prefix}+{args.increment}: uncached {t['uncached_s']:.3f} s, prefix hit "
              f"({t['hit_tokens']} tokens) {t['cached_s']:.3f} s: {t['speedup']:.0f}x", flush=True)
        save(args.out, result)
    else:
        result["skipped"].append("ttft")
    del rank
    if time.perf_counter() - began < args.time_limit and args.peer_batches:
        kl_name = f"{args.model}-kl"
        kl_model = random_model(preset(kl_name), args.device, dtype)
        kl_args = argparse.Namespace(**{**vars(args), "prefix": args.peer_context, "increment": 64,
                                        "batches": args.peer_batches, "num_pages": args.num_pages // 4})
        try:
            result["peer_kimi_linear"] = hf_peer(kl_model, Rank(kl_model, kl_name, kl_args, dtype), kl_args, kl_name)
        except Exception as exc:  # noqa: BLE001 - the peer is reported, never fatal
            result["peer_kimi_linear"] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"peer: {result['peer_kimi_linear']['reason']}")
    else:
        result["skipped"].append("peer")
    result["wall_s"] = time.perf_counter() - began
    save(args.out, result)


def save(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
