"""Multi-cluster: one worker release per cluster plus one control-plane release, all on one shared etcd."""

from __future__ import annotations

import yaml

from tests.deploy.chart import ci_values, container, env_map, of_kind, render_file

CONTROL_PLANE = {"gateway", "admission", "router"}
RELEASES = {"multi-cluster-control-plane": ("global", "us-east-1", "control-plane"),
            "multi-cluster-use1": ("use1", "us-east-1", "cluster"),
            "multi-cluster-euw1": ("euw1", "eu-west-1", "cluster")}


def _objects(name: str):
    return render_file(ci_values(name))


def test_every_object_and_pod_carries_its_cluster():
    for name, (cluster, region, role) in RELEASES.items():
        for obj in _objects(name):
            labels = obj["metadata"]["labels"]
            assert (labels["k3.io/cluster"], labels["k3.io/region"], labels["k3.io/role"]) == (cluster, region, role)
        for deployment in of_kind(_objects(name), "Deployment").values():
            pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
            assert pod_labels["k3.io/cluster"] == cluster
            env = env_map(container(deployment))
            assert (env["K3_CLUSTER"], env["K3_REGION"]) == (cluster, region)


def test_control_plane_release_holds_exactly_gateway_admission_router():
    assert set(of_kind(_objects("multi-cluster-control-plane"), "Deployment")) == CONTROL_PLANE
    for cluster in ("multi-cluster-use1", "multi-cluster-euw1"):
        deployments = set(of_kind(_objects(cluster), "Deployment"))
        assert deployments.isdisjoint(CONTROL_PLANE) and {"prefill", "decode", "kvtransfer"} <= deployments


def test_all_releases_share_one_external_etcd_and_one_token():
    endpoints, secrets = set(), set()
    for name in RELEASES:
        objects = _objects(name)
        assert not of_kind(objects, "StatefulSet"), "multi-cluster releases must not bundle their own etcd"
        for deployment in of_kind(objects, "Deployment").values():
            env = env_map(container(deployment))
            endpoints.add(env["K3_ETCD_ENDPOINTS"])
            secrets.add(env["K3_AUTH_TOKEN"]["secretKeyRef"]["name"])
        assert not of_kind(objects, "Secret"), "the shared token comes from an existing secret"
    assert len(endpoints) == 1 and len(endpoints.pop().split(",")) == 3
    assert secrets == {"k3-auth-token"}


def test_control_plane_gateway_finds_its_router_and_admission():
    config_map = of_kind(_objects("multi-cluster-control-plane"), "ConfigMap")["config"]
    gateway = yaml.safe_load(config_map["data"]["config.yaml"])["gateway"]
    assert gateway["router_address"] == "k3-router.serve.svc:50051"
    assert gateway["admission_address"] == "k3-admission.serve.svc:50051"
