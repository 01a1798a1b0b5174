"""CRIU options that runc 1.1 has no flag for, and how they reach the CRIU that runc starts.

runc drives CRIU over its RPC socket and fixes most options there. CRIU reads two configuration files on
top: the CLI-level one named by `CRIU_CONFIG_FILE` in runc's environment (parsed before the RPC request, so
the request overrides it) and the RPC-level one named by the container's `org.criu.config` annotation (parsed
after the request, so it overrides the request). Each option below goes where it takes effect:

* `network-lock skip` (CLI level; in the RPC-level file CRIU 4.1.1 crashes on it, a NULL argv in its
  option parser): the sandbox's network namespace holds only loopback and every task in it is frozen while
  CRIU dumps it, so nothing can send or receive; the default iptables lock cost 8 iptables processes per
  dump and an unlock pass per restore. The method is recorded in the images, so restore skips it too.
* `manage-cgroups=ignore` (RPC level; runc always asks for `soft`): CRIU neither dumps nor restores cgroup
  properties. runc already puts the restoring CRIU into the new container's cgroups with the bundle's
  limits before CRIU forks anything, so restored tasks land there; dumping the properties meant mounting
  every v1 hierarchy per dump. The one thing it changes: a copy restored from a frozen dump comes back
  running, not frozen (the backend freezes it again where that is wanted).
"""

from __future__ import annotations

from pathlib import Path

CLI_LEVEL = ("network-lock skip",)
RPC_LEVEL = ("manage-cgroups=ignore",)
ANNOTATION = "org.criu.config"


class CriuOptions:
    """Writes both files under `directory`; `env` goes to every runc call, `annotations` into every bundle."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.cli_file = _write(directory / "criu-cli.conf", CLI_LEVEL)
        self.rpc_file = _write(directory / "criu-rpc.conf", RPC_LEVEL)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "CRIU_CONFIG_FILE": str(self.cli_file)}

    @property
    def annotations(self) -> dict[str, str]:
        return {ANNOTATION: str(self.rpc_file)}


def _write(path: Path, options: tuple[str, ...]) -> Path:
    path.write_text("".join(f"{opt}\n" for opt in options))
    return path
