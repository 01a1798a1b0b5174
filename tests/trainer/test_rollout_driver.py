"""`k3 rollout` end to end (real etcd, trainer and decode worker processes): partial rollouts pause
and resume across weight versions, groups reach the trainer with the behaviour log-prob and version of
every token (oracle: plain log-softmax of an independently loaded model of that version), weights are
published every step and the worker serves the last one."""

from __future__ import annotations

import json

import pytest
import torch

from k3.v1 import trainer_pb2, trainer_pb2_grpc
from k3core.model.init import init_weights
from k3core.model.k3model import K3Model
from k3core.presets import preset
from k3core.weights.checkpoint import load_into
from services.runtime.client import sync_channel
from services.trainer import rollout_cli
from services.trainer.driver import Prompt
from services.trainer.rollout_backend import DecodeBackend

PREFIX = "/k3-rollout-driver"
SHORT = Prompt("short", [3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=3)
LONG = Prompt("long", [2, 7, 1, 8, 2, 8, 1, 8], max_new_tokens=40)


def even_fraction(prompt: Prompt, completion: list[int]) -> float:
    return sum(t % 2 == 0 for t in completion) / len(completion)


@torch.no_grad()
def oracle_logprobs(model: K3Model, tokens: list[int]) -> list[float]:
    """log softmax(logits)[t] of every token after the first (temperature 1, no top-k/p)."""
    logits = model.prefill(torch.tensor(tokens), model.new_sequence_cache(), 0).double()
    logp = torch.log_softmax(logits, dim=-1)
    return [0.0] + [logp[i - 1, tokens[i]].item() for i in range(1, len(tokens))]


@pytest.mark.timeout(240)
async def test_driver_runs_partial_rollouts_across_published_versions(spawn, etcd_server, tmp_path):
    etcd = ["--etcd-endpoints", etcd_server, "--etcd-prefix", PREFIX]
    publish = tmp_path / "weights"
    trainer = spawn("serve", "trainer", "--port", "0", "--metrics-port", "-1", "--batch-size", "2",
                    "--publish-dir", str(publish), *etcd, name="trainer")
    decode = spawn("serve", "decode", "--port", "0", "--metrics-port", "0", "--model", "nano",
                   "--hash-block-tokens", "16", "--step-token-budget", "64", "--num-pages", "160", *etcd, name="decode")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": p.prompt_id, "tokens": p.tokens, "max_new_tokens": p.max_new_tokens})
                                 for p in (SHORT, LONG)))
    # `k3 rollout` in process (its main prints a summary; `run` returns the stats the test inspects)
    stats = await rollout_cli.run(rollout_cli.parse([
        "--trainer", trainer.address, "--decode", decode.address, "--decode-metrics", decode.info["metrics_address"],
        "--prompts", str(prompts), "--reward", f"{__name__}:even_fraction", "--publish-dir", str(publish),
        "--samples", "2", "--pause-fraction", "0.5", "--prompts-per-iteration", "2", "--publish-every", "1",
        "--temperature", "1.0", "--ignore-eos"]))
    with sync_channel(trainer.address) as channel:
        status = trainer_pb2_grpc.TrainerServiceStub(channel).GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest())

    # iteration 1: the short group finishes (half of 4), the long ones pause; step 1, v1 published;
    # iteration 2 resumes the two long ones (one may pause once more if the other finished a step earlier).
    assert stats.iterations >= 2 and stats.paused >= 2
    assert stats.step == status.step == 2 and stats.version == status.weight_version == 2
    assert DecodeBackend(decode.address, decode.info["metrics_address"]).served_version() == 2
    by_group: dict[str, list[trainer_pb2.Trajectory]] = {}
    for t in stats.submitted:
        by_group.setdefault(t.session.session_id, []).append(t)
    assert sorted(len(t.tokens.ids) for t in by_group["short"]) == [11, 11]
    assert sorted(len(t.tokens.ids) for t in by_group["long"]) == [48, 48]
    assert all(set(t.policy_versions[8:]) == {0} for t in by_group["short"])
    assert any({0, 1} <= set(t.policy_versions[8:]) for t in by_group["long"])  # spans versions
    for t in stats.submitted:
        assert t.reward == pytest.approx(even_fraction(SHORT, list(t.tokens.ids[8:])))
        assert list(t.loss_mask) == [0] * 8 + [1] * (len(t.tokens.ids) - 8)

    models = {0: init_weights(K3Model(preset("nano")), seed=0).eval()}
    for version in (1, 2):
        models[version] = K3Model(preset("nano")).eval()
        load_into(models[version], publish / f"v{version}")
    for t in stats.submitted:
        tokens = list(t.tokens.ids)
        expected = {v: oracle_logprobs(models[v], tokens) for v in set(t.policy_versions[8:])}
        for i in range(8, len(tokens)):
            assert t.logprobs[i] == pytest.approx(expected[t.policy_versions[i]][i], abs=2e-4), (i, t.policy_versions[i])


def test_rollout_cli_rejects_bad_prompt_lines_and_rewards(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"id": "a", "tokens": [1, 2], "max_new_tokens": 4}) + "\n" + json.dumps({"id": "b"}))
    with pytest.raises(SystemExit, match="prompts.jsonl:2: need id, tokens, max_new_tokens"):
        rollout_cli.load_prompts(bad)
    with pytest.raises(SystemExit, match="--reward 'no_such_module:f'"):
        rollout_cli.load_reward("no_such_module:f")
    assert rollout_cli.load_reward(f"{__name__}:even_fraction") is even_fraction
