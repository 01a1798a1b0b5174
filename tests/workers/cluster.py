"""Real worker processes for the worker tests: a transfer service, prefill and decode workers at chosen
TP degrees, all on loopback, started in parallel (each rank is its own OS process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.processes import ServiceProcess

# nano with 4 KDA heads and 4 MLA heads, so TP 4 divides them (the preset has 2).
OVERRIDES = {"kda_num_heads": 4, "num_attention_heads": 4}
HASH_BLOCK = 16


def worker_args(role: str, tp: int, transfer: str, *extra: str) -> list[str]:
    return ["serve", role, "--port", "0", "--metrics-port", "0", "--model", "nano",
            "--model-overrides", json.dumps(OVERRIDES), "--tp-size", str(tp),
            "--hash-block-tokens", str(HASH_BLOCK), "--step-token-budget", "64", "--num-pages", "160",
            "--transfer-address", transfer, *extra]


def start_all(processes: list[ServiceProcess], timeout: float = 180.0) -> None:
    with ThreadPoolExecutor(len(processes)) as pool:
        for future in [pool.submit(p.start, timeout) for p in processes]:
            future.result()


def make(root: Path, name: str, args: list[str]) -> ServiceProcess:
    return ServiceProcess(args, root / name)


def children(pid: int) -> list[int]:
    """Direct child processes (the worker's TP ranks > 0), whichever thread started them."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def running(procs: dict) -> Iterator[dict]:
    """Start every process of `procs` in parallel, yield the dict, kill them all afterwards (fixture body)."""
    try:
        start_all(list(procs.values()))
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
