"""Service configuration from defaults, a file, the environment and flags (in rising precedence).

Each service subclasses `ServiceConfig` (a dataclass) with its own fields. For a field `max_batch` of the
`decode` service the sources are: `--config FILE` (YAML or JSON, keys as field names, optionally nested under
the service name), `K3_DECODE_MAX_BATCH`, then `--max-batch`. Shared fields also read `K3_<FIELD>`
(`K3_ETCD_ENDPOINTS`, `K3_AUTH_TOKEN`, `K3_CLUSTER`, ...). Values are type-checked and `validate()` range-checks
them; any problem is one `ConfigError` naming every bad field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import types
import typing
from pathlib import Path
from typing import Any, Self

import yaml


class ConfigError(ValueError):
    pass


@dataclasses.dataclass
class ServiceConfig:
    host: str = "127.0.0.1"
    # 0 picks a free port; the chosen address is written to --ready-file.
    port: int = 50051
    # -1 disables the Prometheus endpoint; 0 picks a free port.
    metrics_port: int = 9090
    # The address peers should dial (defaults to host:port).
    advertise_address: str = ""
    cluster: str = "local"
    region: str = "local"
    instance: str = ""
    # Comma-separated host:port list; empty runs without membership.
    etcd_endpoints: str = ""
    etcd_prefix: str = "/k3"
    lease_ttl_s: float = 3.0
    # Shared-token auth on every call except health checks; empty disables it.
    auth_token: str = ""
    drain_grace_s: float = 10.0
    max_message_bytes: int = 64 * 1024 * 1024
    log_level: str = "INFO"
    # A JSON file written once the server is serving: address, metrics_address, pid, service, instance + meta.
    ready_file: str = ""

    SHARED_ENV = ("etcd_endpoints", "etcd_prefix", "auth_token", "cluster", "region", "log_level")

    def validate(self) -> list[str]:
        """Return one message per invalid field; subclasses extend (call super)."""
        problems = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port: must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            problems.append(f"metrics_port: must be in [-1, 65535], got {self.metrics_port}")
        if self.lease_ttl_s < 1:
            problems.append(f"lease_ttl_s: must be >= 1 (etcd lease granularity), got {self.lease_ttl_s}")
        if self.drain_grace_s < 0:
            problems.append(f"drain_grace_s: must be >= 0, got {self.drain_grace_s}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            problems.append(f"log_level: must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        for endpoint in self.etcd_endpoint_list():
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit():
                problems.append(f"etcd_endpoints: {endpoint!r} is not host:port")
        return problems

    def etcd_endpoint_list(self) -> list[str]:
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]

    def instance_name(self) -> str:
        return self.instance or f"{socket.gethostname()}-{os.getpid()}"

    @classmethod
    def load(cls, service: str, argv: list[str] | None = None, env: dict[str, str] | None = None) -> Self:
        env = dict(os.environ if env is None else env)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        parser = argparse.ArgumentParser(prog=f"k3 serve {service}", description=f"K3 Serve {service} service")
        parser.add_argument("--config", help="YAML or JSON config file")
        for name in fields:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar="VALUE")
        args = parser.parse_args(argv)

        raw: dict[str, Any] = {}
        if args.config:
            raw.update(_read_file(Path(args.config), service, fields))
        for name in fields:
            keys = [f"K3_{service.upper()}_{name.upper()}"]
            if name in cls.SHARED_ENV:
                keys.append(f"K3_{name.upper()}")
            for key in keys:
                if key in env:
                    raw[name] = env[key]
                    break
            if getattr(args, name) is not None:
                raw[name] = getattr(args, name)

        values, problems = {}, []
        for name, value in raw.items():
            try:
                values[name] = _coerce(value, hints[name])
            except (TypeError, ValueError) as exc:
                problems.append(f"{name}: {exc}")
        if problems:
            raise ConfigError("invalid configuration: " + "; ".join(problems))
        config = cls(**values)
        problems = config.validate()
        if problems:
            raise ConfigError("invalid configuration: " + "; ".join(problems))
        return config


def _read_file(path: Path, service: str, fields: dict) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}") from exc
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    # A file may hold the config of several services, one section each, plus shared keys at the top.
    merged = {k: v for k, v in data.items() if not isinstance(v, dict) or k in fields}
    if isinstance(data.get(service), dict):
        merged.update(data[service])
    unknown = sorted(k for k in merged if k not in fields)
    if unknown and isinstance(data.get(service), dict) and any(k in data[service] for k in unknown):
        raise ConfigError(f"config file {path}: unknown keys for {service}: {', '.join(unknown)}")
    return {k: v for k, v in merged.items() if k in fields}


def _coerce(value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None or value == "":
            return None
        hint = options[0]
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected an integer, got {value!r}") from None
    if hint is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
    if hint is str:
        if isinstance(value, dict | list):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return str(value)
    if typing.get_origin(hint) in (list, dict) or hint in (list, dict):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"expected JSON for {hint}, got {value!r}") from None
        return value
    return value
