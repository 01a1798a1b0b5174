"""bench/serve.py peer: Hugging Face transformers' `kimi_linear` with our weights against our rank."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.serve_decode import decode_row
from bench.serve_rank import Rank, random_model, sync
from k3core.model import K3Model
from k3core.presets import preset


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
    result["rows"] = [peer_row(peer, rank, args, batch, name) for batch in args.peer_batches]
    del peer
    return result


def peer_row(peer: torch.nn.Module, rank: Rank, args: argparse.Namespace, batch: int, name: str) -> dict:
    """Decode step time of the peer and of our rank at `batch` requests of `--peer-context` tokens."""
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
    ours_s, *_ = decode_row(rank, batch, args.peer_context, args.peer_steps, "peer")
    print(f"peer kimi_linear ({name}) batch {batch} ctx {args.peer_context}: {1e3 * peer_s:.2f} ms/step, "
          f"ours {1e3 * ours_s:.2f} ms/step: {peer_s / ours_s:.1f}x")
    return {"batch": batch, "context": args.peer_context, "peer_step_s": peer_s, "ours_step_s": ours_s,
            "speedup": peer_s / ours_s}


def run_peer(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    """The peer on the Kimi-Linear form of `--model` (`<model>-kl`), ours on the same model; never fatal."""
    kl_name = f"{args.model}-kl"
    kl_model = random_model(preset(kl_name), args.device, dtype)
    kl_args = argparse.Namespace(**{**vars(args), "prefix": args.peer_context, "increment": 64,
                                    "batches": args.peer_batches, "num_pages": args.num_pages // 4})
    try:
        return hf_peer(kl_model, Rank(kl_model, kl_name, kl_args, dtype), kl_args, kl_name)
    except Exception as exc:  # noqa: BLE001 - the peer is reported, never fatal
        result = {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:400]}
        print(f"peer: {result['reason']}")
        return result
