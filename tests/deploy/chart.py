"""Offline rendering of helm/k3 through the Helm v4 SDK (helm-python-sdk), as parsed Kubernetes objects."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "k3"
CI_VALUES = sorted((CHART_DIR / "ci").glob("*-values.yaml"))
RELEASE = "k3"
# Every service the chart can deploy, written out here rather than read from values.yaml.
SERVICES = ("gateway", "admission", "router", "prefill", "decode", "kvtransfer", "sandbox", "trainer")
NAMESPACE = "serve"
# Minimal values that install: the chart refuses to invent the fleet-wide auth token.
MINIMAL = {"auth": {"token": "0123456789abcdef-test"}}

Obj = dict[str, Any]


@cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART_DIR))


def load_values(path: Path) -> dict[str, Any]:
    """A values file parsed by Helm's own YAML reader (what `helm install -f` does: anchors, merge keys)."""
    return helm_python.values_from_yaml(path.read_text())


def render(values: dict[str, Any], release: str = RELEASE) -> tuple[Obj, ...]:
    """Every object the chart renders for `values` (NOTES.txt and empty documents skipped); read-only."""
    return _render(json.dumps(values, sort_keys=True), release)


@cache
def _render(values_json: str, release: str) -> tuple[Obj, ...]:
    manifests = chart().render(json.loads(values_json), name=release, namespace=NAMESPACE)
    objects: list[Obj] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return tuple(objects)


def render_file(path: Path) -> tuple[Obj, ...]:
    return render(load_values(path))


def of_kind(objects: tuple[Obj, ...], kind: str) -> dict[str, Obj]:
    """Objects of one kind keyed by their app.kubernetes.io/component label (or name when unlabelled)."""
    found = {}
    for obj in objects:
        if obj["kind"] == kind:
            labels = obj["metadata"].get("labels", {})
            found[labels.get("app.kubernetes.io/component", obj["metadata"]["name"])] = obj
    return found


def container(deployment: Obj) -> Obj:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_map(container_spec: Obj) -> dict[str, Any]:
    """name -> value, or the valueFrom mapping for downward-API and secret entries."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_spec.get("env", [])}


def ci_values(name: str) -> Path:
    path = CHART_DIR / "ci" / f"{name}-values.yaml"
    assert path.exists(), path
    return path


def pod_env(deployment: Obj, pod_ip: str = "10.1.2.3") -> dict[str, str]:
    """The container env as the kubelet would resolve it: downward-API fields filled in (pod IP, name
    `pod-0`), secret references replaced by a stand-in token, $(VAR) references expanded."""
    env: dict[str, str] = {}
    for name, value in env_map(container(deployment)).items():
        if isinstance(value, dict):
            ref = value.get("fieldRef", {}).get("fieldPath")
            value = {"status.podIP": pod_ip, "metadata.name": "pod-0"}.get(ref, "secret-token-from-kubelet")
        env[name] = value.replace("$(K3_POD_IP)", pod_ip)
    return env
