"""`k3 scale --kube` and the Kubernetes drill faults, against a FAKE API server that records calls
(no kube-apiserver can run here). The local-fleet paths are tested for real in tests/fleet/."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from services.cli.drill.faults import KubeFault
from services.cli.scale_cmd import parse_targets, scale_kube
from tests.cli.fake_kube_api import FakeKubeApi


def workload(name: str, component: str, cluster: str, replicas: int) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": "k3",
                         "labels": {"app.kubernetes.io/component": component, "k3.io/cluster": cluster}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"x": "y"}}, "template": {}}}


def pod(name: str, component: str, cluster: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "k3",
                         "labels": {"app.kubernetes.io/component": component, "k3.io/cluster": cluster}},
            "spec": {"containers": []}}


def api_client(url: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = url
    return client.ApiClient(configuration)


def test_scale_patches_only_the_selected_cluster():
    objects = {"deployments": [workload("k3-decode-east", "decode", "east", 2),
                               workload("k3-decode-west", "decode", "west", 2),
                               workload("k3-router", "router", "global", 1)],
               "statefulsets": []}
    with FakeKubeApi(objects) as fake:
        apps = client.AppsV1Api(api_client(fake.url))
        changed = scale_kube(apps, "k3", "decode", 5, "east")
    assert changed == ["deployment/k3-decode-east: 2 -> 5"]
    patches = [c for c in fake.calls if c[0] == "PATCH"]
    assert patches == [("PATCH", "/apis/apps/v1/namespaces/k3/deployments/k3-decode-east/scale",
                        {"spec": {"replicas": 5}})]
    assert objects["deployments"][1]["spec"]["replicas"] == 2


def test_scale_unknown_workload_is_an_error():
    with FakeKubeApi({"deployments": [], "statefulsets": []}) as fake:
        with pytest.raises(RuntimeError, match="no workload matches"):
            scale_kube(client.AppsV1Api(api_client(fake.url)), "k3", "decode", 1, "nowhere")


def test_parse_targets_rejects_bad_input():
    assert parse_targets(["decode=3", "router=2"]) == [("decode", 3), ("router", 2)]
    for bad in ("decode", "decode=x", "wizard=2"):
        with pytest.raises(ValueError):
            parse_targets([bad])


def test_kill_cluster_deletes_exactly_that_clusters_pods():
    objects = {"pods": [pod("decode-east-0", "decode", "east"), pod("prefill-east-0", "prefill", "east"),
                        pod("decode-west-0", "decode", "west")]}
    with FakeKubeApi(objects) as fake:
        fault = KubeFault("kill-cluster", api_client(fake.url), "k3", "east", 1.0)
        text = asyncio.run(fault.inject())
    assert "deleted 2 pods" in text
    assert sorted(p["metadata"]["name"] for p in objects["pods"]) == ["decode-west-0"]
    deletes = [c for c in fake.calls if c[0] == "DELETE"]
    assert len(deletes) == 2 and all("gracePeriodSeconds=0" in c[1] for c in deletes)


def test_partition_etcd_gives_the_cluster_an_egress_allow_list_without_etcd_then_removes_it():
    objects: dict = {"networkpolicies": []}
    with FakeKubeApi(objects) as fake:
        fault = KubeFault("partition-etcd", api_client(fake.url), "k3", "east", 0.0)
        asyncio.run(fault.inject())
        spec = objects["networkpolicies"][0]["spec"]
        assert spec["podSelector"] == {"matchLabels": {"k3.io/cluster": "east"}}
        assert spec["policyTypes"] == ["Egress"]
        peers, dns = spec["egress"]
        assert peers["to"][0]["podSelector"]["matchExpressions"] == [
            {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["etcd"]}]
        assert {p["port"] for p in dns["ports"]} == {53}
        asyncio.run(fault.heal())
    assert objects["networkpolicies"] == []
