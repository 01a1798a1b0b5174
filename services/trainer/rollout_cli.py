"""`k3 rollout`: run the rollout driver over a prompt file until every prompt is rolled out.

    k3 rollout --trainer HOST:PORT --decode HOST:PORT --decode-metrics HOST:PORT --prompts prompts.jsonl \\
        --reward my_pkg.rewards:score --publish-dir /shared/weights [--samples 4 --pause-fraction 0.7 ...]

prompts.jsonl: one {"id": str, "tokens": [int], "max_new_tokens": int} per line. The reward is
`module:function`, called as function(Prompt, completion_tokens) -> float. The behaviour model starts
at the trainer's current version (`<publish-dir>/v<N>`; version 0: `--checkpoint`, else the preset's
seeded weights, as the trainer and workers start) and the worker must serve that version.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
from pathlib import Path

from k3.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from k3core.model.init import init_weights
from k3core.model.k3model import K3Model
from k3core.presets import preset
from services.runtime.client import aio_channel
from services.trainer.behaviour import BehaviourPolicy
from services.trainer.driver import DriverConfig, DriverStats, Prompt, RewardFn, RolloutDriver
from services.trainer.rollout_backend import DecodeBackend


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="k3 rollout", description=__doc__.split("\n")[0])
    p.add_argument("--trainer", required=True)
    p.add_argument("--decode", required=True, help="decode worker gRPC address")
    p.add_argument("--decode-metrics", required=True, help="its Prometheus host:port (weights version)")
    p.add_argument("--prompts", required=True, type=Path)
    p.add_argument("--reward", required=True, help="module:function")
    p.add_argument("--publish-dir", required=True)
    p.add_argument("--model", default="nano")
    p.add_argument("--checkpoint", default="", help="weights of version 0 (default: the seeded preset)")
    p.add_argument("--weights-seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--pause-fraction", type=float, default=0.7)
    p.add_argument("--prompts-per-iteration", type=int, default=8)
    p.add_argument("--publish-every", type=int, default=1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="generate every max_new_tokens (benchmarks, tests)")
    p.add_argument("--auth-token", default="")
    return p.parse_args(argv)


def load_prompts(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(Prompt(str(row["id"]), [int(t) for t in row["tokens"]], int(row["max_new_tokens"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}:{number}: need id, tokens, max_new_tokens ({exc})") from exc
    return prompts


def load_reward(spec: str) -> RewardFn:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SystemExit(f"--reward {spec!r}: not an importable module:function ({exc})") from exc


async def run(args: argparse.Namespace) -> DriverStats:
    prompts, reward = load_prompts(args.prompts), load_reward(args.reward)
    sampling = common_pb2.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                         ignore_eos=args.ignore_eos)
    backend = DecodeBackend(args.decode, args.decode_metrics, model=args.model, token=args.auth_token)
    channel = aio_channel(args.trainer, args.auth_token)
    try:
        trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
        version = (await trainer.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest())).weight_version
        model = init_weights(K3Model(preset(args.model)), seed=args.weights_seed)
        policy = BehaviourPolicy(model, sampling)
        start = Path(args.publish_dir) / f"v{version}" if version else Path(args.checkpoint) if args.checkpoint else None
        if start is not None:
            policy.load(start)
        await backend.wait_version(version)
        config = DriverConfig(publish_dir=args.publish_dir, samples_per_prompt=args.samples,
                              pause_fraction=args.pause_fraction, prompts_per_iteration=args.prompts_per_iteration,
                              publish_every_steps=args.publish_every, sampling=sampling, seed=args.seed)
        return await RolloutDriver(backend, trainer, policy, reward, config).run(prompts)
    finally:
        await channel.close()
        await backend.close()


def main(argv: list[str]) -> None:
    stats = asyncio.run(run(parse(argv)))
    print(json.dumps({"iterations": stats.iterations, "paused": stats.paused, "trajectories": len(stats.submitted),
                      "step": stats.step, "weight_version": stats.version}))
