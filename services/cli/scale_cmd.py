"""`k3 scale SERVICE=N [SERVICE=N ...] [--cluster C]`: scale services on the local fleet, or on Kubernetes
with `--kube` (Deployments/StatefulSets selected by the chart's labels `app.kubernetes.io/component` and
`k3.io/cluster`, scaled through the official `kubernetes` client)."""

from __future__ import annotations

import argparse

from services.cli import fleet

SERVICES = fleet.CONTROL_PLANE + fleet.PER_CLUSTER + fleet.OPTIONAL


def parse_targets(items: list[str]) -> list[tuple[str, int]]:
    targets = []
    for item in items:
        service, sep, count = item.partition("=")
        if not sep or not count.isdigit():
            raise ValueError(f"bad target {item!r}: write SERVICE=N, e.g. decode=3")
        if service not in SERVICES:
            raise ValueError(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}")
        targets.append((service, int(count)))
    return targets


def scale_kube(apps_api, namespace: str, service: str, replicas: int, cluster: str) -> list[str]:
    selector = f"app.kubernetes.io/component={service}"
    if cluster:
        selector += f",k3.io/cluster={cluster}"
    changed = []
    for kind, lister, patcher in (
        ("deployment", apps_api.list_namespaced_deployment, apps_api.patch_namespaced_deployment_scale),
        ("statefulset", apps_api.list_namespaced_stateful_set, apps_api.patch_namespaced_stateful_set_scale),
    ):
        for obj in lister(namespace, label_selector=selector).items:
            patcher(obj.metadata.name, namespace, {"spec": {"replicas": replicas}})
            changed.append(f"{kind}/{obj.metadata.name}: {obj.spec.replicas} -> {replicas}")
    if not changed:
        raise RuntimeError(f"no workload matches {selector} in namespace {namespace}")
    return changed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k3 scale", description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="+", help="SERVICE=N")
    parser.add_argument("--cluster", default="", help="cluster to scale in (local default: c0 for workers)")
    parser.add_argument("--kube", action="store_true")
    parser.add_argument("--namespace", default="k3")
    args = parser.parse_args(argv)
    try:
        targets = parse_targets(args.targets)
    except ValueError as exc:
        parser.error(str(exc))
    if args.kube:
        from kubernetes import client, config

        config.load_kube_config()
        apps = client.AppsV1Api()
        for service, replicas in targets:
            for line in scale_kube(apps, args.namespace, service, replicas, args.cluster):
                print(line)
        return 0
    for service, replicas in targets:
        cluster = args.cluster or ("global" if service in fleet.CONTROL_PLANE + fleet.OPTIONAL else "c0")
        for line in fleet.scale(service, replicas, cluster) or [f"{service} in {cluster} already at {replicas}"]:
            print(line)
    return 0
