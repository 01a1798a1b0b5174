"""A small NetworkPolicy evaluator (ingress only) used as the oracle for the chart's policies.

It follows the Kubernetes semantics the chart relies on: a pod selected by no Ingress policy accepts
everything; otherwise a connection is allowed when some rule of some selecting policy matches both the port and
the peer; a rule without `from` matches every peer; a podSelector without a namespaceSelector means the policy's
own namespace.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Peer:
    labels: dict[str, str] = field(default_factory=dict)
    namespace: str = "serve"
    namespace_labels: dict[str, str] = field(default_factory=dict)
    ip: str = "10.0.0.1"


def _matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    assert not (selector or {}).get("matchExpressions"), "evaluator handles matchLabels only"
    return all(labels.get(k) == v for k, v in (selector or {}).get("matchLabels", {}).items())


def _peer_matches(rule_peer: dict[str, Any], src: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        block = rule_peer["ipBlock"]
        ip = ipaddress.ip_address(src.ip)
        inside = ip in ipaddress.ip_network(block["cidr"])
        return inside and not any(ip in ipaddress.ip_network(c) for c in block.get("except", []))
    if "namespaceSelector" in rule_peer:
        if not _matches(rule_peer["namespaceSelector"], src.namespace_labels):
            return False
    elif src.namespace != policy_namespace:
        return False
    return _matches(rule_peer.get("podSelector"), src.labels)


def _port_matches(rule_ports: list[dict[str, Any]] | None, port_name: str, port_number: int) -> bool:
    if not rule_ports:
        return True
    return any(p.get("port") in (port_name, port_number) for p in rule_ports)


def allowed(policies: list[dict[str, Any]], dst_labels: dict[str, str], port_name: str, port_number: int,
            src: Peer, dst_namespace: str = "serve") -> bool:
    selecting = [p for p in policies
                 if p["metadata"]["namespace"] == dst_namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _matches(p["spec"]["podSelector"], dst_labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if not _port_matches(rule.get("ports"), port_name, port_number):
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_matches(p, src, dst_namespace) for p in peers):
                return True
    return False
