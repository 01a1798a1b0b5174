"""Pods as the chart renders them, run as real processes: container args + the ConfigMap file + the pod env
(etcd, ports and hosts rewritten to loopback) start the real services against a real etcd; the image's health
command reports SERVING; SIGTERM drains them inside the pod's termination grace period. The CPU-dev prefill
and decode pods (nano model on the CPU) run the same way under `-m slow`.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from services.runtime.local_etcd import EtcdServer
from tests.deploy.chart import REPO, ci_values, container, of_kind, pod_env, render_file
from tests.support.processes import ServiceProcess

# Started in this order: the gateway dials the router and admission it is given.
SERVICES = ["admission", "router", "kvtransfer", "gateway"]
# The CPU-dev release runs the workers on the CPU (nano model), so their pods can run here too.
WORKERS = ["prefill", "decode"]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("services", [SERVICES, pytest.param(WORKERS, marks=pytest.mark.slow)],
                         ids=["control-plane", "workers"])
def test_rendered_pods_serve_and_drain(etcd, tmp_path, services):
    objects = render_file(ci_values("cpu-dev"))
    config_file = tmp_path / "config.yaml"
    config_file.write_text(of_kind(objects, "ConfigMap")["config"]["data"]["config.yaml"])
    deployments = of_kind(objects, "Deployment")
    started: dict[str, ServiceProcess] = {}
    try:
        for name in services:
            spec = container(deployments[name])
            prefix = f"K3_{name.upper()}_"
            env = pod_env(deployments[name]) | {
                "K3_ETCD_ENDPOINTS": etcd.endpoint, prefix + "HOST": "127.0.0.1", prefix + "PORT": "0",
                prefix + "METRICS_PORT": "0", prefix + "ADVERTISE_ADDRESS": "", "K3_AUTH_TOKEN": "t" * 20}
            if name == "gateway":
                env |= {prefix + "HTTP_PORT": "0", prefix + "ROUTER_ADDRESS": started["router"].address,
                        prefix + "ADMISSION_ADDRESS": started["admission"].address}
            args = [a.replace("/etc/k3/config.yaml", str(config_file)) for a in spec["args"]]
            process = ServiceProcess(args, tmp_path / name, env=env)
            started[name] = process
            process.start(timeout=60)
        for name, process in started.items():
            health = subprocess.run([sys.executable, "-m", "services.cli.main", "health", "--address",
                                     process.address], capture_output=True, text=True, timeout=30, cwd=REPO)
            assert health.stdout.strip() == "SERVING", (name, health.stdout, process.log()[-2000:])
        for name in reversed(services):
            grace = deployments[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            started[name].signal(signal.SIGTERM)
            assert started[name].wait(timeout=grace) == 0, started[name].log()[-2000:]
    finally:
        for process in started.values():
            process.kill()
