"""Gateway configuration."""

from __future__ import annotations

import dataclasses

from services.runtime import ServiceConfig


@dataclasses.dataclass
class GatewayConfig(ServiceConfig):
    # OpenAI-compatible HTTP front door; 0 picks a free port (published as `http_address`).
    http_port: int = 8080
    model: str = "nano"
    # Longest prompt accepted, in tokens (HTTP 400 beyond it).
    max_prompt_tokens: int = 32_768
    max_output_tokens: int = 4_096
    # Static peers for running without etcd; with etcd they are discovered.
    router_address: str = ""
    admission_address: str = ""
    # Clusters to try for one request before giving up (primary, then its backup, ...).
    max_attempts: int = 3
    # Fine hash-block size of the prefix cache; must equal the workers' so the router can probe prefixes.
    hash_block_tokens: int = 512
    # How long a request waits for a router that knows a healthy cluster (e.g. while membership reconverges
    # after an etcd outage) before it fails with 503; about two lease TTLs.
    route_wait_s: float = 6.0
    request_timeout_s: float = 600.0
    # Mid-stream failure: continue on the backup by re-prefilling prompt + tokens sent so far.
    resume_mid_stream: bool = True

    def validate(self) -> list[str]:
        problems = super().validate()
        if not 0 <= self.http_port <= 65535:
            problems.append(f"http_port: must be in [0, 65535], got {self.http_port}")
        if self.max_prompt_tokens < 1:
            problems.append("max_prompt_tokens: must be >= 1")
        if self.route_wait_s < 0:
            problems.append(f"route_wait_s: must be >= 0, got {self.route_wait_s}")
        if self.hash_block_tokens < 1:
            problems.append(f"hash_block_tokens: must be >= 1, got {self.hash_block_tokens}")
        if self.max_attempts < 1:
            problems.append("max_attempts: must be >= 1")
        return problems
