"""Pods as the chart renders them, run as real processes: container args + the ConfigMap file + the pod env
(etcd, ports and hosts rewritten to loopback) start the real services against a real etcd; the image's health
command reports SERVING; SIGTERM drains them inside the pod's termination grace period. The CPU-dev prefill
and decode pods (nano model on the CPU) run the same way under `-m slow`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.runtime.local_etcd import EtcdServer
from tests.deploy.chart import REPO, ci_values, container, of_kind, pod_env, render_file
from tests.support.processes import ServiceProcess

# Start stages in order (the gateway dials the router and admission it is given); pods of a stage start
# together. The CPU-dev release runs the workers on the CPU (nano model), so their pods can run here too.
CONTROL_PLANE = [["admission", "router", "kvtransfer"], ["gateway"]]
WORKERS = [["prefill", "decode"]]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.stop()


def _pod_process(deployment, name: str, config_file, workdir, etcd, started) -> ServiceProcess:
    prefix = f"K3_{name.upper()}_"
    env = pod_env(deployment) | {
        "K3_ETCD_ENDPOINTS": etcd.endpoint, prefix + "HOST": "127.0.0.1", prefix + "PORT": "0",
        prefix + "METRICS_PORT": "0", prefix + "ADVERTISE_ADDRESS": "", "K3_AUTH_TOKEN": "t" * 20}
    if name == "gateway":
        env |= {prefix + "HTTP_PORT": "0", prefix + "ROUTER_ADDRESS": started["router"].address,
                prefix + "ADMISSION_ADDRESS": started["admission"].address}
    args = [a.replace("/etc/k3/config.yaml", str(config_file)) for a in container(deployment)["args"]]
    return ServiceProcess(args, workdir / name, env=env)


@pytest.mark.parametrize("stages", [CONTROL_PLANE, pytest.param(WORKERS, marks=pytest.mark.slow)],
                         ids=["control-plane", "workers"])
def test_rendered_pods_serve_and_drain(etcd, tmp_path, stages):
    objects = render_file(ci_values("cpu-dev"))
    config_file = tmp_path / "config.yaml"
    config_file.write_text(of_kind(objects, "ConfigMap")["config"]["data"]["config.yaml"])
    deployments = of_kind(objects, "Deployment")
    started: dict[str, ServiceProcess] = {}
    try:
        for stage in stages:
            batch = {name: _pod_process(deployments[name], name, config_file, tmp_path, etcd, started)
                     for name in stage}
            started |= batch
            with ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(lambda process: process.start(timeout=90), batch.values()))
        # The image's HEALTHCHECK command, one per pod, concurrently.
        checks = {name: subprocess.Popen([sys.executable, "-m", "services.cli.main", "health", "--address",
                                          process.address], stdout=subprocess.PIPE, text=True, cwd=REPO)
                  for name, process in started.items()}
        for name, check in checks.items():
            out, _ = check.communicate(timeout=60)
            assert out.strip() == "SERVING", (name, out, started[name].log()[-2000:])
        for process in started.values():
            process.signal(signal.SIGTERM)
        for name, process in started.items():
            grace = deployments[name]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert process.wait(timeout=grace) == 0, process.log()[-2000:]
    finally:
        for process in started.values():
            process.kill()
