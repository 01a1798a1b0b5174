"""The `k3` operator tool and the chart agree: its label selectors find the chart's objects, and the chart's
operator Role grants every API call it makes.

The Kubernetes API here is a FAKE (no kube-apiserver runs on these machines): it serves the objects the chart
rendered, filters them by the label selector the CLI sends, and records the calls.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.cli.drill.faults import KubeFault
from services.cli.scale_cmd import scale_kube
from tests.deploy.chart import MINIMAL, ci_values, load_values, of_kind, render, render_file


def _selected(labels: dict[str, str], selector: str) -> bool:
    return all(labels.get(key) == value for key, _, value in (term.partition("=") for term in selector.split(",")))


class FakeAppsApi:
    """Serves rendered Deployments/StatefulSets; records (verb, resource, name) like the API server would."""

    def __init__(self, objects):
        self.objects, self.calls = objects, []

    def _list(self, kind, resource, namespace, label_selector):
        self.calls.append(("list", resource, None))
        items = [SimpleNamespace(metadata=SimpleNamespace(name=o["metadata"]["name"]),
                                 spec=SimpleNamespace(replicas=o["spec"].get("replicas")))
                 for o in self.objects if o["kind"] == kind and o["metadata"]["namespace"] == namespace
                 and _selected(o["metadata"]["labels"], label_selector)]
        return SimpleNamespace(items=items)

    def list_namespaced_deployment(self, namespace, label_selector):
        return self._list("Deployment", "deployments", namespace, label_selector)

    def list_namespaced_stateful_set(self, namespace, label_selector):
        return self._list("StatefulSet", "statefulsets", namespace, label_selector)

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.calls.append(("patch", "deployments/scale", name))

    def patch_namespaced_stateful_set_scale(self, name, namespace, body):
        self.calls.append(("patch", "statefulsets/scale", name))


def _role_allows(role, group: str, resource: str, verb: str) -> bool:
    return any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
               for rule in role["rules"])


@pytest.mark.parametrize("cluster,deployment", [("use1", "k3-use1-decode"), ("euw1", "k3-euw1-decode")])
def test_scale_finds_only_the_clusters_deployment_and_is_permitted(cluster, deployment):
    # Two cluster releases side by side in one namespace: the selector must pick the right one.
    objects = (render(load_values(ci_values("multi-cluster-use1")), release="k3-use1")
               + render(load_values(ci_values("multi-cluster-euw1")), release="k3-euw1"))
    api = FakeAppsApi(objects)
    changed = scale_kube(api, "serve", "decode", 12, cluster)
    assert changed == [f"deployment/{deployment}: None -> 12"]
    assert ("patch", "deployments/scale", deployment) in api.calls
    role = of_kind(render_file(ci_values(f"multi-cluster-{cluster}")), "Role")["operator"]
    for verb, resource, _ in api.calls:
        assert _role_allows(role, "apps", resource, verb), (verb, resource)


def test_scale_reaches_the_bundled_etcd_statefulset():
    api = FakeAppsApi(render_file(ci_values("single-cluster")))
    assert scale_kube(api, "serve", "etcd", 3, "prod-use1") == ["statefulset/k3-etcd: 3 -> 3"]


def test_drill_pod_selectors_match_the_chart_pods():
    objects = render_file(ci_values("single-cluster"))
    pod_labels = [o["spec"]["template"]["metadata"]["labels"] for o in objects
                  if o["kind"] in ("Deployment", "StatefulSet")]
    selectors = []

    def list_namespaced_pod(namespace, label_selector):
        selectors.append(label_selector)
        return SimpleNamespace(items=[])

    fault = KubeFault("kill-worker", None, "serve", "prod-use1", 5.0)
    fault.core = SimpleNamespace(list_namespaced_pod=list_namespaced_pod)
    fault._pods("decode")
    fault._pods()
    worker, cluster = selectors
    assert [labels["app.kubernetes.io/component"] for labels in pod_labels if _selected(labels, worker)] == ["decode"]
    assert len([labels for labels in pod_labels if _selected(labels, cluster)]) == len(pod_labels)


def test_operator_role_grants_the_drill_calls_only_when_drills_are_on():
    role = of_kind(render_file(ci_values("single-cluster")), "Role")["operator"]
    assert _role_allows(role, "", "pods", "delete")
    assert _role_allows(role, "networking.k8s.io", "networkpolicies", "create")
    assert _role_allows(role, "networking.k8s.io", "networkpolicies", "delete")
    locked = of_kind(render({**MINIMAL, "operator": {"rbac": {"drills": False}}}), "Role")["operator"]
    assert not _role_allows(locked, "", "pods", "delete")
    assert _role_allows(locked, "apps", "deployments/scale", "patch")
    binding = of_kind(render(MINIMAL), "RoleBinding")["operator"]
    account = of_kind(render(MINIMAL), "ServiceAccount")["operator"]
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    assert binding["roleRef"]["name"] == locked["metadata"]["name"]
