"""Every values file renders, lints clean, and every object passes the Kubernetes schemas in strict mode."""

from __future__ import annotations

from pathlib import Path

import helm_python
import kubernetes_validate
import pytest

from tests.deploy.chart import CHART_DIR, CI_VALUES, chart, load_values, render_file

# The chart's kubeVersion floor and the newest schema kubernetes-validate ships.
KUBE_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
EXPECTED_FILES = {"single-cluster", "multi-cluster-control-plane", "multi-cluster-use1", "multi-cluster-euw1",
                  "cpu-dev", "etcd-external"}


def test_ci_values_cover_every_deployment_shape():
    assert {p.name.removesuffix("-values.yaml") for p in CI_VALUES} == EXPECTED_FILES


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_object_is_valid_kubernetes(values_file: Path, kube_version: str):
    objects = render_file(values_file)
    assert len(objects) > 5
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for {kube_version}: {exc.message}")


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_helm_lint_has_no_errors(values_file: Path):
    report = helm_python.lint(str(CHART_DIR), load_values(values_file), strict=True, namespace="serve")
    errors = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not errors, errors


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_names_are_unique_and_namespaced(values_file: Path):
    objects = render_file(values_file)
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))
    assert all(o["metadata"]["namespace"] == "serve" for o in objects)
    # Deployment names leave room for the ReplicaSet and pod suffixes inside a 63-char label.
    assert all(len(o["metadata"]["name"]) <= 47 for o in objects)


def test_packaged_chart_renders_the_same(tmp_path):
    """`helm package` honours .helmignore (ci/ and docs stay out); the archive must still hold the schema."""
    archive = helm_python.package(str(CHART_DIR), destination=str(tmp_path))
    with helm_python.Chart.load(archive) as packaged:
        assert packaged.schema is not None
        assert not [f for f in packaged.files if f["name"].startswith("ci/")]
        values = load_values(CI_VALUES[0])
        assert packaged.render(values, name="k3", namespace="serve") == chart().render(
            values, name="k3", namespace="serve")
