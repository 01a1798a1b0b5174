"""Real service processes for integration tests: started with a ready file, killed for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class ServiceProcess:
    def __init__(self, args: list[str], workdir: Path, env: dict[str, str] | None = None):
        self.args = args
        self.workdir = Path(workdir)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    @property
    def ready_file(self) -> Path:
        return self.workdir / "ready.json"

    @property
    def address(self) -> str:
        return self.info["address"]

    @property
    def log_path(self) -> Path:
        return self.workdir / "service.log"

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "services.cli.main", *self.args, "--ready-file", str(self.ready_file)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "ab"),
                                     env=self.env, cwd=Path(__file__).resolve().parents[2])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args} exited {self.proc.returncode}: {self.log()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"{self.args} not ready in {timeout}s: {self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
