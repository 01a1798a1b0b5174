"""Deployments: one per enabled service, GPU pods sized to their TP group, gRPC probes, safe rollouts."""

from __future__ import annotations

import pytest

from tests.deploy.chart import (
    CI_VALUES,
    MINIMAL,
    SERVICES,
    ci_values,
    container,
    env_map,
    load_values,
    of_kind,
    render,
    render_file,
)

ALL = set(SERVICES)
GPU = {"prefill", "decode", "trainer"}


def _enabled(values_name: str) -> set[str]:
    services = load_values(ci_values(values_name)).get("services", {})
    # The chart's defaults enable everything but the trainer.
    return {s for s in ALL if services.get(s, {}).get("enabled", s != "trainer")}


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_one_deployment_service_and_policy_per_enabled_service(values_file):
    objects = render_file(values_file)
    expected = _enabled(values_file.name.removesuffix("-values.yaml"))
    assert set(of_kind(objects, "Deployment")) == expected
    assert set(of_kind(objects, "Service")) - {"etcd"} == expected
    policies_on = load_values(values_file).get("networkPolicy", {}).get("enabled", True)
    assert set(of_kind(objects, "NetworkPolicy")) - {"etcd"} == (expected if policies_on else set())


def test_disabled_services_leave_nothing_behind():
    objects = render({**MINIMAL, "services": {"sandbox": {"enabled": False}, "kvtransfer": {"enabled": False}}})
    for obj in objects:
        component = obj["metadata"]["labels"].get("app.kubernetes.io/component")
        assert component not in ("sandbox", "kvtransfer"), f"{obj['kind']}/{obj['metadata']['name']}"
        assert not obj["metadata"]["name"].endswith(("-sandbox", "-kvtransfer"))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gpu_workers_request_one_gpu_per_tp_rank(tp):
    objects = render({**MINIMAL, "services": {"decode": {"tensorParallel": tp}, "trainer": {"enabled": True}}})
    deployments = of_kind(objects, "Deployment")
    decode = container(deployments["decode"])
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == tp
    assert decode["resources"]["requests"]["nvidia.com/gpu"] == tp
    assert env_map(decode)["K3_DECODE_TP_SIZE"] == str(tp)
    assert env_map(decode)["K3_DECODE_DEVICE"] == "cuda"
    assert container(deployments["prefill"])["resources"]["limits"]["nvidia.com/gpu"] == 8
    for name in ALL - GPU:
        resources = container(deployments[name])["resources"]
        assert "nvidia.com/gpu" not in resources.get("limits", {}) | resources.get("requests", {})


def test_gpu_pods_land_on_gpu_nodes_with_shared_memory_and_weights():
    objects = render({**MINIMAL, "modelStorage": {"volume": {"persistentVolumeClaim": {"claimName": "w"}}},
                      "services": {"trainer": {"enabled": True}}})
    for name, deployment in of_kind(objects, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
        if name in GPU:
            assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
            assert volumes["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": "w"}}
            assert mounts["model"]["readOnly"] is (name != "trainer")
            assert container(deployment)["image"].endswith("/k3-gpu-worker:0.1.0")
        else:
            assert "nodeSelector" not in pod and "model" not in volumes
            assert container(deployment)["image"].endswith("/k3-control-plane:0.1.0")


def test_topology_spread_selects_the_service_own_pods():
    objects = render(MINIMAL)
    for deployment in of_kind(objects, "Deployment").values():
        spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in spread} == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
        for constraint in spread:
            assert constraint["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
            assert constraint["matchLabelKeys"] == ["pod-template-hash"]


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_probes_are_grpc_health_on_the_service_port(values_file):
    for name, deployment in of_kind(render_file(values_file), "Deployment").items():
        spec = container(deployment)
        grpc_port = next(p["containerPort"] for p in spec["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert spec[probe]["grpc"] == {"port": grpc_port, "service": ""}, (name, probe)
        assert spec["args"] == ["serve", name, "--config", "/etc/k3/config.yaml"]


def test_startup_probe_covers_model_load_on_gpu_workers():
    deployments = of_kind(render(MINIMAL), "Deployment")
    budget = {n: container(d)["startupProbe"]["periodSeconds"] * container(d)["startupProbe"]["failureThreshold"]
              for n, d in deployments.items()}
    assert budget["decode"] == budget["prefill"] == 30 * 60
    assert budget["gateway"] == 5 * 60
    # Liveness only kills what stayed broken for a while; readiness reacts within seconds.
    decode = container(deployments["decode"])
    live, ready = decode["livenessProbe"], decode["readinessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 10


@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.stem)
def test_rollouts_never_drop_below_serving_capacity(values_file):
    for deployment in of_kind(render_file(values_file), "Deployment").values():
        strategy = deployment["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate"
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0
        assert strategy["rollingUpdate"]["maxSurge"] >= 1


def test_termination_grace_covers_drain_and_prestop():
    deployments = of_kind(render(MINIMAL), "Deployment")
    for name, drain in {"decode": 300, "prefill": 120, "gateway": 30}.items():
        pod = deployments[name]["spec"]["template"]["spec"]
        assert container(deployments[name])["lifecycle"]["preStop"]["sleep"]["seconds"] == 5
        assert pod["terminationGracePeriodSeconds"] == drain + 5 + 10


def test_replicas_left_to_the_autoscaler_when_it_is_on():
    deployments = of_kind(render({**MINIMAL, "services": {"router": {"autoscaling": {"enabled": False},
                                                                       "replicas": 3}}}), "Deployment")
    assert "replicas" not in deployments["decode"]["spec"]
    assert deployments["router"]["spec"]["replicas"] == 3


def test_pods_run_non_root_read_only_except_the_sandbox_manager():
    for name, deployment in of_kind(render(MINIMAL), "Deployment").items():
        security = container(deployment)["securityContext"]
        assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
        if name == "sandbox":
            assert security["runAsUser"] == 0 and "CHECKPOINT_RESTORE" in security["capabilities"]["add"]
            continue
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}


def test_service_env_uses_the_runtime_naming():
    decode = container(of_kind(render({**MINIMAL, "services": {"decode": {"env": {"MAX_BATCH": 64}}}}),
                               "Deployment")["decode"])
    env = env_map(decode)
    assert env["K3_DECODE_MAX_BATCH"] == "64"
    assert env["K3_AUTH_TOKEN"] == {"secretKeyRef": {"name": "k3-auth", "key": "token"}}
    assert env["K3_ETCD_ENDPOINTS"] == "k3-etcd.serve.svc:2379"
    assert env["K3_DECODE_ADVERTISE_ADDRESS"] == "$(K3_POD_IP):50051"
    assert env["K3_DECODE_INSTANCE"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_config_change_rolls_only_the_pods_that_read_it():
    def checksums(values):
        return {name: d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for name, d in of_kind(render(values), "Deployment").items()}

    base = checksums(MINIMAL)
    shared = checksums({**MINIMAL, "config": {"log_level": "DEBUG"}})
    assert all(shared[name] != base[name] for name in base)
    # A gateway-only change must not restart GPU workers (a restart is a model reload).
    gateway_only = checksums({**MINIMAL, "services": {"gateway": {"config": {"max_attempts": 5}}}})
    assert {name for name in base if gateway_only[name] != base[name]} == {"gateway"}


def test_headless_services_for_workers_pinned_by_the_router():
    services = of_kind(render(MINIMAL), "Service")
    for name in ("prefill", "decode", "kvtransfer", "sandbox"):
        assert services[name]["spec"]["clusterIP"] == "None"
    assert services["gateway"]["spec"]["type"] == "ClusterIP"
    assert {p["name"]: p["port"] for p in services["gateway"]["spec"]["ports"]} == {
        "grpc": 50051, "metrics": 9090, "http": 8080}


def test_scheduling_overrides_pass_through_per_service():
    anti_affinity = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}]}}
    values = {**MINIMAL, "services": {"decode": {
        "affinity": anti_affinity, "priorityClassName": "k3-serving",
        "tolerations": [{"key": "dedicated", "value": "k3", "effect": "NoSchedule"}],
        "topologySpread": [{"topologyKey": "topology.kubernetes.io/zone", "maxSkew": 2,
                            "whenUnsatisfiable": "DoNotSchedule"}]}}}
    deployments = of_kind(render(values), "Deployment")
    pod = deployments["decode"]["spec"]["template"]["spec"]
    assert pod["affinity"] == anti_affinity and pod["priorityClassName"] == "k3-serving"
    # Lists replace the defaults instead of appending to them.
    assert pod["tolerations"] == [{"key": "dedicated", "value": "k3", "effect": "NoSchedule"}]
    assert [(c["maxSkew"], c["whenUnsatisfiable"]) for c in pod["topologySpreadConstraints"]] == [
        (2, "DoNotSchedule")]
    assert "affinity" not in deployments["prefill"]["spec"]["template"]["spec"]
