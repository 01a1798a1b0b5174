"""Finding this cluster's KV transfer service: the request's address, the configured one, or etcd."""

from __future__ import annotations

from services.engine.config import WorkerConfig
from services.runtime import errors
from services.runtime.registry import Watcher


class TransferDirectory:
    def __init__(self, config: WorkerConfig):
        self.config = config
        endpoints = config.etcd_endpoint_list()
        self.watcher = Watcher(endpoints, config.etcd_prefix) if endpoints and not config.transfer_address else None

    def resolve(self, requested: str) -> str:
        if requested:
            return requested
        if self.config.transfer_address:
            return self.config.transfer_address
        if self.watcher is not None:
            for record in self.watcher.snapshot().values():
                if record.service == "kvtransfer" and record.cluster == self.config.cluster:
                    return record.address
        raise errors.Unavailable(f"no KV transfer service known in cluster {self.config.cluster!r} "
                                 "(set transfer_address or register one in etcd)", retry_after_ms=1000)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
