"""`k3`: run a service, a local fleet, and operate it.

    k3 serve SERVICE [--flags]     run one service in the foreground (SERVICE: see `k3 serve --help`)
    k3 up [--clusters N]           start a local fleet of real processes on loopback, wait for health
    k3 status                      table of the local fleet's instances, health and key metrics
    k3 down                        drain and stop the local fleet
    k3 health --address HOST:PORT  grpc.health.v1 check (exit 0 when SERVING; for container probes)
    k3 plan ...                    memory planner for a model preset
    k3 rollout ...                 rollout driver: partial rollouts on a decode worker feeding the trainer
"""

from __future__ import annotations

import importlib
import sys

# Service name -> module whose `main(argv)` runs it.
SERVICES = {
    "gateway": "services.gateway.server",
    "admission": "services.admission.server",
    "router": "services.router.server",
    "prefill": "services.prefill.server",
    "decode": "services.decode.server",
    "kvtransfer": "services.kvtransfer.server",
    "sandbox": "services.sandbox.server",
    "trainer": "services.trainer.server",
}


def serve(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: k3 serve SERVICE [--flags]\n\nservices: " + ", ".join(SERVICES)
              + "\n(or a dotted module path with a main(argv) function)")
        return
    name, rest = argv[0], argv[1:]
    module_name = SERVICES.get(name, name if "." in name else None)
    if module_name is None:
        raise SystemExit(f"k3 serve: unknown service {name!r}; choose one of {', '.join(SERVICES)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SystemExit(f"k3 serve: service {name!r} is not available ({exc})") from exc
    module.main(rest)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "serve": serve,
        "up": lambda a: _run("services.cli.fleet_cmd", "up", a),
        "down": lambda a: _run("services.cli.fleet_cmd", "down", a),
        "status": lambda a: _run("services.cli.fleet_cmd", "status", a),
        "health": lambda a: _run("services.cli.health_cmd", "main", a),
        "plan": lambda a: _run("k3core.planner", "main", a),
        "drill": lambda a: _run("services.cli.drill_cmd", "main", a),
        "scale": lambda a: _run("services.cli.scale_cmd", "main", a),
        "rollout": lambda a: _run("services.trainer.rollout_cli", "main", a),
    }
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv[0] not in commands:
        raise SystemExit(f"k3: unknown command {argv[0]!r}\n{__doc__}")
    commands[argv[0]](argv[1:])


def _run(module: str, function: str, argv: list[str]) -> None:
    try:
        target = getattr(importlib.import_module(module), function)
    except (ModuleNotFoundError, AttributeError) as exc:
        raise SystemExit(f"k3: this command is not available yet ({exc})") from exc
    result = target(argv)
    if isinstance(result, int) and result:
        raise SystemExit(result)


if __name__ == "__main__":
    main()
