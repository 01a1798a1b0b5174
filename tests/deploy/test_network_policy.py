"""The rendered NetworkPolicies admit exactly the service graph, checked pair by pair with an evaluator."""

from __future__ import annotations

import itertools

import pytest

from tests.deploy.chart import MINIMAL, SERVICES, ci_values, of_kind, render, render_file
from tests.deploy.netpol import Peer, allowed

# The intended graph, written from the data flow (client -> gateway -> admission/router -> prefill/decode,
# pages prefill -> kvtransfer -> decode, trainer beside it), independently of values.yaml.
EDGES = {
    ("gateway", "admission"), ("gateway", "router"), ("admission", "router"),
    *itertools.product(["gateway", "admission", "router", "trainer"], ["prefill", "decode"]),
    ("prefill", "decode"), ("decode", "prefill"),
    ("prefill", "kvtransfer"), ("decode", "kvtransfer"), ("router", "kvtransfer"),
    ("kvtransfer", "prefill"), ("kvtransfer", "decode"),
    ("gateway", "sandbox"), ("trainer", "sandbox"), ("gateway", "trainer"),
}
MONITORING = Peer(labels={"app": "prometheus"}, namespace="monitoring",
                  namespace_labels={"kubernetes.io/metadata.name": "monitoring"})


def k3_pod(component: str) -> Peer:
    return Peer(labels={"app.kubernetes.io/part-of": "k3", "app.kubernetes.io/component": component,
                        "app.kubernetes.io/instance": "other-release"})


def _pod_labels(objects, component: str) -> dict[str, str]:
    return of_kind(objects, "Deployment")[component]["spec"]["template"]["metadata"]["labels"]


@pytest.fixture(scope="module")
def everything():
    objects = render({**MINIMAL, "services": {"trainer": {"enabled": True}}})
    return objects, list(of_kind(objects, "NetworkPolicy").values())


def test_every_pod_is_selected_by_a_policy(everything):
    objects, policies = everything
    stranger = Peer(labels={"app": "curl"})
    for name in SERVICES:
        assert not allowed(policies, _pod_labels(objects, name), "metrics", 9090, stranger), name


@pytest.mark.parametrize("src,dst", list(itertools.product(SERVICES, SERVICES)))
def test_grpc_admits_exactly_the_service_graph(everything, src, dst):
    objects, policies = everything
    got = allowed(policies, _pod_labels(objects, dst), "grpc", 50051, k3_pod(src))
    assert got == ((src, dst) in EDGES or dst == "gateway"), f"{src} -> {dst}"


def test_clients_reach_only_the_gateway(everything):
    objects, policies = everything
    client = Peer(labels={"app": "client"}, namespace="apps")
    for name in SERVICES:
        expect = name == "gateway"
        assert allowed(policies, _pod_labels(objects, name), "grpc", 50051, client) is expect, name
    assert allowed(policies, _pod_labels(objects, "gateway"), "http", 8080, client)


def test_operator_tool_reaches_every_grpc_port(everything):
    objects, policies = everything
    for name in SERVICES:
        assert allowed(policies, _pod_labels(objects, name), "grpc", 50051, k3_pod("operator")), name


def test_metrics_only_from_the_monitoring_namespace(everything):
    objects, policies = everything
    for name in SERVICES:
        labels = _pod_labels(objects, name)
        assert allowed(policies, labels, "metrics", 9090, MONITORING), name
        assert not allowed(policies, labels, "metrics", 9090, k3_pod("gateway")), name


def test_bundled_etcd_admits_k3_pods_and_its_peers_only(everything):
    objects, policies = everything
    etcd = of_kind(objects, "StatefulSet")["etcd"]["spec"]["template"]["metadata"]["labels"]
    for name in [*SERVICES, "operator"]:
        assert allowed(policies, etcd, "client", 2379, k3_pod(name)), name
    assert not allowed(policies, etcd, "client", 2379, Peer(labels={"app": "curl"}))
    assert not allowed(policies, etcd, "peer", 2380, k3_pod("router"))
    assert allowed(policies, etcd, "peer", 2380, Peer(labels=dict(etcd)))


def test_client_peers_restrict_the_gateway():
    values = {**MINIMAL, "networkPolicy": {"clientPeers": [{"ipBlock": {"cidr": "192.168.0.0/16"}}]}}
    objects = render(values)
    policies = list(of_kind(objects, "NetworkPolicy").values())
    gateway = _pod_labels(objects, "gateway")
    assert allowed(policies, gateway, "http", 8080, Peer(ip="192.168.4.4", namespace="x"))
    assert not allowed(policies, gateway, "http", 8080, Peer(ip="10.9.9.9", namespace="x"))


def test_remote_control_plane_reaches_the_cluster_workers_only():
    objects = render_file(ci_values("multi-cluster-use1"))
    policies = list(of_kind(objects, "NetworkPolicy").values())
    remote_router = Peer(labels={"app.kubernetes.io/component": "router"}, namespace="k3", ip="10.10.3.7")
    stranger = Peer(ip="10.99.0.1", namespace="k3")
    for name in ("prefill", "decode", "kvtransfer", "sandbox"):
        labels = _pod_labels(objects, name)
        assert allowed(policies, labels, "grpc", 50051, remote_router), name
        assert not allowed(policies, labels, "grpc", 50051, stranger), name


def test_policies_can_be_turned_off():
    assert not of_kind(render({**MINIMAL, "networkPolicy": {"enabled": False}}), "NetworkPolicy")
