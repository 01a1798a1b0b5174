"""The trainer service: `k3 serve trainer --model nano`."""

from __future__ import annotations

from collections.abc import Callable

from k3.v1 import trainer_pb2_grpc
from k3core.model.init import init_weights
from k3core.model.k3model import K3Model
from k3core.presets import preset
from services.runtime import ServiceApp
from services.runtime.registry import connect
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner
from services.trainer.service import TrainerServicer


def etcd_publisher(config: TrainerConfig) -> Callable[[str, str], int] | None:
    """Announce a published version under <prefix>/<key>; workers watch it. Returns workers registered."""
    endpoints = config.etcd_endpoint_list()
    if not endpoints:
        return None

    def publish(key: str, value: str) -> int:
        client = connect(endpoints)
        try:
            client.put(f"{config.etcd_prefix}/{key}", value)
            workers = client.get_prefix(f"{config.etcd_prefix}/instances/")
            return sum(1 for _, meta in workers if b"/decode/" in meta.key or b"/prefill/" in meta.key)
        finally:
            client.close()
    return publish


def main(argv: list[str]) -> None:
    config = TrainerConfig.load("trainer", argv)
    model = init_weights(K3Model(preset(config.model)), seed=config.seed)
    learner = Learner(model, lr=config.lr, tau=config.tau, qk_clip_tau=config.qk_clip_tau)
    app = ServiceApp("trainer", config)
    servicer = TrainerServicer(learner, config.batch_size, config.model, config.publish_dir, etcd_publisher(config))
    app.add_service(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer, "k3.v1.TrainerService")
    app.run()
