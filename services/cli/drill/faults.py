"""Real faults: processes killed with SIGKILL, etcd frozen, transfers throttled; on Kubernetes, pods deleted
and etcd cut off with a NetworkPolicy.

Each fault has `inject()` (returns a description) and `heal()` (undo what can be undone; a killed cluster
stays dead, as in a real outage).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Protocol

from services.cli import fleet

KINDS = ("kill-cluster", "kill-worker", "partition-etcd", "slow-transfer")


class Fault(Protocol):
    target_cluster: str

    async def inject(self) -> str: ...

    async def heal(self) -> None: ...


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class LocalFault:
    """Faults against the local fleet of `k3 up` (real processes, real signals)."""

    def __init__(self, kind: str, state: fleet.FleetState, cluster: str, duration_s: float):
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; choose one of {', '.join(KINDS)}")
        if cluster not in state.clusters:
            raise ValueError(f"unknown cluster {cluster!r}; the fleet has {', '.join(state.clusters)}")
        self.kind, self.state, self.target_cluster, self.duration_s = kind, state, cluster, duration_s
        self._task: asyncio.Task | None = None
        self._stopped: list[int] = []

    def _members(self, service: str | None = None) -> list[fleet.Member]:
        return [m for m in self.state.members if m.cluster == self.target_cluster
                and (service is None or m.service == service) and fleet.alive(m.pid)]

    async def inject(self) -> str:
        if self.kind == "kill-cluster":
            victims = self._members()
            _signal([m.pid for m in victims], signal.SIGKILL)
            return f"SIGKILL {len(victims)} processes of cluster {self.target_cluster}: " + \
                ", ".join(m.name for m in victims)
        if self.kind == "kill-worker":
            victims = self._members("decode")[:1]
            if not victims:
                raise RuntimeError(f"cluster {self.target_cluster} has no live decode worker")
            _signal([victims[0].pid], signal.SIGKILL)
            return f"SIGKILL {victims[0].name}"
        if self.kind == "partition-etcd":
            if not self.state.etcd_pid:
                raise RuntimeError("the fleet uses an external etcd; partition it with your network tools")
            self._stopped = [self.state.etcd_pid]
            _signal(self._stopped, signal.SIGSTOP)
            self._task = asyncio.create_task(self._resume_after(self.duration_s))
            return f"etcd frozen (SIGSTOP) for {self.duration_s:.1f}s: every lease refresh and watch stalls"
        pids = [m.pid for m in self._members("kvtransfer")]
        if not pids:
            raise RuntimeError(f"cluster {self.target_cluster} has no kvtransfer process")
        self._stopped = pids
        self._task = asyncio.create_task(self._throttle(pids, self.duration_s))
        return f"kvtransfer of {self.target_cluster} throttled to 20% duty for {self.duration_s:.1f}s"

    async def _resume_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        _signal(self._stopped, signal.SIGCONT)

    async def _throttle(self, pids: list[int], duration: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + duration
        try:
            while loop.time() < end:
                _signal(pids, signal.SIGSTOP)
                await asyncio.sleep(0.08)
                _signal(pids, signal.SIGCONT)
                await asyncio.sleep(0.02)
        finally:
            _signal(pids, signal.SIGCONT)

    async def heal(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        _signal(self._stopped, signal.SIGCONT)


class KubeFault:
    """Faults against a Kubernetes fleet deployed by the chart (labels `app.kubernetes.io/component` and
    `k3.io/cluster`), through the official `kubernetes` client."""

    def __init__(self, kind: str, api_client, namespace: str, cluster: str, duration_s: float):
        from kubernetes import client

        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; choose one of {', '.join(KINDS)}")
        self.kind, self.namespace, self.target_cluster, self.duration_s = kind, namespace, cluster, duration_s
        self.core = client.CoreV1Api(api_client)
        self.net = client.NetworkingV1Api(api_client)
        self.policy_name = f"k3-drill-partition-etcd-{cluster}"

    def _pods(self, component: str | None = None) -> list:
        selector = f"k3.io/cluster={self.target_cluster}"
        if component:
            selector += f",app.kubernetes.io/component={component}"
        return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items

    async def inject(self) -> str:
        if self.kind in ("kill-cluster", "kill-worker"):
            pods = self._pods(None if self.kind == "kill-cluster" else "decode")
            pods = pods if self.kind == "kill-cluster" else pods[:1]
            for pod in pods:
                self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, grace_period_seconds=0)
            return f"deleted {len(pods)} pods (grace 0): " + ", ".join(p.metadata.name for p in pods)
        if self.kind == "partition-etcd":
            # NetworkPolicies only ever add permissions, and the chart already lets every k3 pod reach etcd,
            # so a deny on etcd's side changes nothing. Instead the target cluster's pods get an egress
            # allow-list without etcd (in-namespace k3 pods and DNS only); the chart sets no egress policy,
            # so this one decides. An external etcd is cut off the same way.
            body = {
                "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": self.policy_name, "labels": {"k3.io/drill": "partition-etcd"}},
                "spec": {
                    "podSelector": {"matchLabels": {"k3.io/cluster": self.target_cluster}},
                    "policyTypes": ["Egress"],
                    "egress": [
                        {"to": [{"podSelector": {"matchExpressions": [
                            {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["etcd"]}]}}]},
                        {"to": [{"namespaceSelector": {}}],
                         "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                    ],
                },
            }
            self.net.create_namespaced_network_policy(self.namespace, body)
            return (f"NetworkPolicy {self.policy_name} cuts cluster {self.target_cluster} off etcd "
                    f"for {self.duration_s:.0f}s")
        raise RuntimeError("slow-transfer is a local-fleet drill; on Kubernetes use your CNI's traffic shaping")

    async def heal(self) -> None:
        if self.kind == "partition-etcd":
            self.net.delete_namespaced_network_policy(self.policy_name, self.namespace)
