"""HPAs scale each Deployment on its own load signal with CPU as fallback; PDBs guard every service."""

from __future__ import annotations

import pytest

from tests.deploy.chart import CI_VALUES, MINIMAL, ci_values, of_kind, render, render_file

# The load signal each service scales on: queue depth, pool usage, in-flight work and cost.
SIGNALS = {
    "gateway": {"k3_rpc_in_flight"},
    "admission": {"k3_rpc_in_flight"},
    "router": set(),
    "prefill": {"k3_prefill_waiting", "k3_prefill_pool_usage"},
    "decode": {"k3_decode_pool_usage", "k3_decode_waiting", "k3_admission_in_use"},
    "kvtransfer": {"k3_kvtransfer_bytes_held"},
    "sandbox": {"k3_sandbox_sandboxes"},
}


def _metric_names(hpa) -> set[str]:
    names = set()
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] in ("Pods", "External"):
            names.add(metric[metric["type"].lower()]["metric"]["name"])
    return names


def test_each_service_scales_on_its_own_signal_plus_cpu():
    objects = render(MINIMAL)
    hpas = of_kind(objects, "HorizontalPodAutoscaler")
    deployments = of_kind(objects, "Deployment")
    assert set(hpas) == set(SIGNALS)
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": deployments[name]["metadata"]["name"]}
        assert _metric_names(hpa) == SIGNALS[name]
        cpu = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
        assert cpu == [{"type": "Resource", "resource": {
            "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_pool_usage_target_is_a_fraction_and_gpu_scale_down_is_slow():
    hpas = of_kind(render(MINIMAL), "HorizontalPodAutoscaler")
    decode = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpas["decode"]["spec"]["metrics"]
              if m["type"] == "Pods"}
    assert decode["k3_decode_pool_usage"] == {"type": "AverageValue", "averageValue": "800m"}
    (cost,) = [m["external"] for m in hpas["decode"]["spec"]["metrics"] if m["type"] == "External"]
    # Admitted cost of this cluster only, spread over the decode pods.
    assert cost["metric"]["selector"] == {"matchLabels": {"cluster": "local"}}
    assert cost["target"]["type"] == "AverageValue"
    # A GPU worker takes minutes to load: never flap it.
    assert hpas["decode"]["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 600
    assert hpas["gateway"]["spec"]["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0


def test_external_metrics_and_cpu_off():
    values = {**MINIMAL, "cluster": {"name": "use1", "region": "us-east-1", "role": "cluster"},
              "services": {"prefill": {"autoscaling": {"cpuUtilization": 0, "metrics": [
                  {"type": "External", "name": "k3_admission_in_use", "perCluster": True,
                   "selector": {"matchLabels": {"request_class": "LONG"}}, "value": "9000000"}]}}}}
    hpa = of_kind(render(values), "HorizontalPodAutoscaler")["prefill"]
    assert hpa["spec"]["metrics"] == [{"type": "External", "external": {
        "metric": {"name": "k3_admission_in_use",
                   "selector": {"matchLabels": {"request_class": "LONG", "cluster": "use1"}}},
        "target": {"type": "Value", "value": "9000000"}}}]


def test_cpu_dev_runs_fixed_replicas_without_hpa_or_pdb():
    objects = render_file(ci_values("cpu-dev"))
    assert not of_kind(objects, "HorizontalPodAutoscaler")
    assert not of_kind(objects, "PodDisruptionBudget")
    assert all(d["spec"]["replicas"] == 1 for d in of_kind(objects, "Deployment").values())


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_pdbs_select_exactly_their_deployment(values_file):
    objects = render_file(values_file)
    deployments = of_kind(objects, "Deployment")
    for name, pdb in of_kind(objects, "PodDisruptionBudget").items():
        target = deployments.get(name) or of_kind(objects, "StatefulSet")[name]
        assert pdb["spec"]["selector"] == target["spec"]["selector"]
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])


def test_pdb_budgets():
    objects = render({**MINIMAL, "services": {"trainer": {"enabled": True}}})
    pdbs = of_kind(objects, "PodDisruptionBudget")
    assert "trainer" not in pdbs
    for name in ("gateway", "admission", "router"):
        assert pdbs[name]["spec"]["minAvailable"] == 1
    for name in ("prefill", "decode", "kvtransfer", "sandbox"):
        assert pdbs[name]["spec"]["maxUnavailable"] == 1
        assert pdbs[name]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_etcd_quorum_guard_only_with_three_members():
    one = render({**MINIMAL, "etcd": {"bundled": {"replicas": 1}}})
    three = render({**MINIMAL, "etcd": {"bundled": {"replicas": 3}}})
    assert "etcd" not in of_kind(one, "PodDisruptionBudget")
    assert of_kind(three, "PodDisruptionBudget")["etcd"]["spec"]["maxUnavailable"] == 1
