"""The trainer as a real process: bad trajectories get INVALID_ARGUMENT naming the field; a full batch
steps the policy; publishing writes a loadable checkpoint of the trained (not the initial) weights, once per
version even when two publishers race, and announces it in etcd."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from k3.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from k3core.model.init import init_weights
from k3core.model.k3model import K3Model
from k3core.presets import preset
from k3core.weights.checkpoint import load_into
from services.runtime.client import sync_channel
from services.runtime.registry import connect


def trajectory(tokens, reward=1.0, session="s"):
    n = len(tokens)
    return trainer_pb2.Trajectory(session=common_pb2.SessionRef(session_id=session),
                                  tokens=common_pb2.TokenIds(ids=tokens), logprobs=[0.0] * n,
                                  loss_mask=[0, 0] + [1] * (n - 2), reward=reward)


PREFIX = "/k3-trainer-test"  # its own: a worker later in the session on the shared etcd must not load these weights


def test_trainer_service(spawn, etcd_server, tmp_path):
    svc = spawn("serve", "trainer", "--port", "0", "--metrics-port", "-1", "--batch-size", "2",
                "--publish-dir", str(tmp_path / "weights"), "--etcd-endpoints", etcd_server, "--etcd-prefix", PREFIX,
                name="trainer")
    with sync_channel(svc.address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        bad = trajectory([1, 2, 3])
        del bad.logprobs[:]
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTrajectories(trainer_pb2.SubmitTrajectoriesRequest(trajectories=[bad]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "trajectories[0].logprobs" in err.value.details()

        reply = stub.SubmitTrajectories(trainer_pb2.SubmitTrajectoriesRequest(
            trajectories=[trajectory([1, 2, 3, 4], 1.0), trajectory([1, 2, 5, 6], 0.0)]))
        assert reply.accepted == 2 and reply.step == 1

        published = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(version=1))
        assert published.workers_updated == 0  # no prefill/decode instance is registered in this test
        with pytest.raises(grpc.RpcError) as stale:
            stub.PublishWeights(trainer_pb2.PublishWeightsRequest(version=1))
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert stub.GetTrainerStatus(trainer_pb2.GetTrainerStatusRequest()).weight_version == 1

        def publish_v2() -> grpc.StatusCode:
            try:
                stub.PublishWeights(trainer_pb2.PublishWeightsRequest(version=2))
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                return exc.code()

        with ThreadPoolExecutor(2) as pool:
            codes = sorted(pool.map(lambda _: publish_v2(), range(2)), key=lambda c: c.name)
        assert codes == [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OK]

    trained = K3Model(preset("nano"))
    load_into(trained, tmp_path / "weights" / "v1")  # strict: every tensor present
    initial = init_weights(K3Model(preset("nano")), seed=0).state_dict()  # what the trainer started from
    assert any(not torch.equal(t, initial[name]) for name, t in trained.state_dict().items())
    client = connect([etcd_server])
    value, _ = client.get(f"{PREFIX}/weights/nano")
    client.close()
    assert json.loads(value) == {"version": 2, "location": str(tmp_path / "weights" / "v2")}
