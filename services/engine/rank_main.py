"""Entry point of a worker's rank > 0: `python -m services.engine.rank_main ROLE RANK PORT <config flags>`."""

from __future__ import annotations

import sys

from services.engine.config import WorkerConfig
from services.engine.worker import run_rank


def main(argv: list[str]) -> None:
    role, rank, port, rest = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    config = WorkerConfig.load(role, rest, env={})
    run_rank(config, role, rank, port)


if __name__ == "__main__":
    main(sys.argv[1:])
