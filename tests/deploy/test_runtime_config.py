"""The chart speaks the runtime's config language: each pod's file + env loads through the real loader.

services/runtime/config.py is the service side of the contract (config file sections, K3_* env, field names);
loading the rendered ConfigMap and container env through it catches a renamed field or a bad value here
instead of in a crash-looping pod.
"""

from __future__ import annotations

import importlib

import pytest
import yaml

from services.cli.main import SERVICES
from services.runtime.config import ServiceConfig
from tests.deploy.chart import CI_VALUES, ci_values, container, of_kind, pod_env, render_file

POD_IP = "10.1.2.3"


def _config_class(service: str) -> type[ServiceConfig]:
    """The ServiceConfig subclass the service's server module loads (what `k3 serve SERVICE` uses)."""
    module = importlib.import_module(SERVICES[service])
    (found,) = {value for value in vars(module).values()
                if isinstance(value, type) and issubclass(value, ServiceConfig) and value is not ServiceConfig}
    return found


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_every_pod_config_loads_and_validates(values_file, tmp_path):
    objects = render_file(values_file)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(of_kind(objects, "ConfigMap")["config"]["data"]["config.yaml"])
    for name, deployment in of_kind(objects, "Deployment").items():
        env = pod_env(deployment, POD_IP)
        config = _config_class(name).load(name, ["--config", str(config_file)], env=env)
        labels = deployment["metadata"]["labels"]
        assert config.host == "0.0.0.0"
        assert config.port == 50051 and config.metrics_port == 9090
        assert (config.cluster, config.region) == (labels["k3.io/cluster"], labels["k3.io/region"])
        assert config.advertise_address == f"{POD_IP}:50051"
        assert config.instance == "pod-0"
        assert config.auth_token == "secret-token-from-kubelet"
        assert config.etcd_endpoint_list() == env["K3_ETCD_ENDPOINTS"].split(",")
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert config.drain_grace_s < grace
        gpus = container(deployment)["resources"].get("limits", {}).get("nvidia.com/gpu")
        if hasattr(config, "tp_size"):
            # One pod holds one TP group: its ranks are exactly the GPUs it asked for.
            assert config.tp_size == (gpus or 1) and config.device == ("cuda" if gpus else "cpu")


def test_gateway_http_port_comes_from_the_chart():
    objects = render_file(ci_values("single-cluster"))
    data = yaml.safe_load(of_kind(objects, "ConfigMap")["config"]["data"]["config.yaml"])
    assert data["gateway"]["http_port"] == 8080
