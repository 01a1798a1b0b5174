"""Run a real etcd server on free loopback ports: the local fleet's embedded default and the tests' fixture."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from services.runtime.ports import free_port


class EtcdServer:
    def __init__(self, data_dir: Path, binary: str | None = None, detach: bool = False):
        # detach: run in its own session so it outlives the process that started it (the local fleet).
        self.detach = detach
        self.binary = binary or shutil.which("etcd") or "/usr/bin/etcd"
        self.data_dir = Path(data_dir)
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 15.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.client_port}"
        with open(self.data_dir / "etcd.log", "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [self.binary, "--name", "k3test", "--data-dir", str(self.data_dir),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"k3test={peer}", "--log-level", "error"],
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=self.detach)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {(self.data_dir / 'etcd.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("etcd did not start in time")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
