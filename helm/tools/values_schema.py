"""Generates helm/k3/values.schema.json, the install-time check of the chart's values.

Run `python helm/tools/values_schema.py` after changing values.yaml's shape; tests/deploy checks that the
committed JSON matches this file. Written in Python because a 1000-line hand-edited JSON drifts.
"""

import json
from pathlib import Path

SERVICES = ["gateway", "admission", "router", "prefill", "decode", "kvtransfer", "sandbox", "trainer"]
dns_label = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 40}
quantity = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "number", "minimum": 0},
                      {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$"}]}
obj = {"type": "object"}
strmap = {"type": "object", "additionalProperties": {"type": "string"}}
probe = {"type": "object", "additionalProperties": False, "properties": {
    "periodSeconds": {"type": "integer", "minimum": 1},
    "failureThreshold": {"type": "integer", "minimum": 1},
    "timeoutSeconds": {"type": "integer", "minimum": 1},
    "initialDelaySeconds": {"type": "integer", "minimum": 0}}}
metric = {
    "type": "object", "additionalProperties": False, "required": ["type", "name"],
    "properties": {
        "type": {"enum": ["Pods", "External"]},
        "name": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$",
                 "description": "metric name as the prometheus adapter serves it (the Prometheus series name)"},
        "selector": obj,
        "perCluster": {"type": "boolean", "description": "External only: select this release's cluster"},
        "averageValue": quantity, "value": quantity},
    "allOf": [
        {"if": {"properties": {"type": {"const": "Pods"}}},
         "then": {"required": ["averageValue"], "not": {"anyOf": [{"required": ["value"]}, {"required": ["perCluster"]}]}}},
        {"if": {"properties": {"type": {"const": "External"}}},
         "then": {"anyOf": [{"required": ["value"]}, {"required": ["averageValue"]}]}}]}
service_spec = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "enabled": {"type": "boolean"},
        "image": {"enum": ["controlPlane", "gpuWorker"]},
        "replicas": {"type": "integer", "minimum": 0},
        "gpu": {"type": "boolean"},
        "tensorParallel": {"enum": [1, 2, 4, 8, 16],
                           "description": "GPUs per pod: one pod per tensor-parallel group"},
        "resources": {"type": "object", "additionalProperties": False,
                      "properties": {"requests": {"type": "object", "additionalProperties": quantity},
                                     "limits": {"type": "object", "additionalProperties": quantity}}},
        "env": {"type": "object", "additionalProperties": False,
                "description": "suffixes of K3_<SERVICE>_* variables: upper case, digits, underscores",
                "patternProperties": {"^[A-Z][A-Z0-9_]*$": {"type": ["string", "number", "boolean"]}}},
        "extraEnv": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "config": obj,
        "nodeSelector": strmap,
        "tolerations": {"type": "array", "items": obj},
        "affinity": obj,
        "topologySpread": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "required": ["topologyKey", "maxSkew", "whenUnsatisfiable"],
            "properties": {"topologyKey": {"type": "string", "minLength": 1},
                           "maxSkew": {"type": "integer", "minimum": 1},
                           "whenUnsatisfiable": {"enum": ["DoNotSchedule", "ScheduleAnyway"]}}}},
        "priorityClassName": {"type": "string"},
        "podAnnotations": strmap,
        "podLabels": strmap,
        "drainSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "preStopSleepSeconds": {"type": "integer", "minimum": 0, "maximum": 60},
        "probes": {"type": "object", "additionalProperties": False, "properties": {
            "healthService": {"type": "string"},
            "startup": probe, "readiness": probe, "liveness": probe}},
        "rollingUpdate": {"type": "object", "additionalProperties": False, "properties": {
            "maxSurge": {"anyOf": [{"type": "integer", "minimum": 1},
                                   {"type": "string", "pattern": "^[1-9][0-9]*%$"}]},
            "maxUnavailable": {"const": 0,
                               "description": "fixed at 0: a rollout never drops below serving capacity"}}},
        "pdb": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"},
            "minAvailable": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%$"}]},
            "maxUnavailable": {"anyOf": [{"type": "integer", "minimum": 1},
                                         {"type": "string", "pattern": "^[1-9][0-9]*%$"}]}}},
        "autoscaling": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"},
            "minReplicas": {"type": "integer", "minimum": 1},
            "maxReplicas": {"type": "integer", "minimum": 1},
            "cpuUtilization": {"type": "integer", "minimum": 0, "maximum": 100},
            "metrics": {"type": "array", "items": metric},
            "behavior": obj}},
        "service": {"type": "object", "additionalProperties": False, "properties": {
            "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
            "headless": {"type": "boolean"},
            "annotations": strmap}},
        "securityContext": obj,
        "extraVolumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "extraVolumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}},
    }}
peers = {"type": "array", "items": {"type": "object", "minProperties": 1,
                                    "description": "a NetworkPolicyPeer (ipBlock, namespaceSelector, podSelector)"}}
image_ref = {"type": "object", "additionalProperties": False, "required": ["repository"], "properties": {
    "repository": {"type": "string", "minLength": 1},
    "digest": {"type": "string", "pattern": "^(sha256:[a-f0-9]{64})?$"}}}
schema = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "K3 Serve chart values",
    "type": "object", "additionalProperties": False,
    "required": ["cluster", "image", "auth", "etcd", "services", "serviceDefaults"],
    "$defs": {"serviceSpec": service_spec},
    "properties": {
        "global": obj,
        "cluster": {"type": "object", "additionalProperties": False, "required": ["name", "region", "role"],
                    "properties": {"name": dns_label, "region": dns_label,
                                   "role": {"enum": ["all", "cluster", "control-plane"]}}},
        "image": {"type": "object", "additionalProperties": False, "properties": {
            "registry": {"type": "string", "minLength": 1},
            "tag": {"type": "string", "not": {"const": "latest"}, "description": "pin a version, never latest"},
            "pullPolicy": {"enum": ["IfNotPresent", "Always", "Never"]},
            "pullSecrets": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            "controlPlane": image_ref, "gpuWorker": image_ref}},
        "auth": {"type": "object", "additionalProperties": False, "properties": {
            "token": {"type": "string", "anyOf": [{"maxLength": 0}, {"minLength": 16}],
                      "description": "shared service token, at least 16 characters"},
            "existingSecret": {"type": "string"},
            "secretKey": {"type": "string", "minLength": 1}}},
        "etcd": {
            "type": "object", "additionalProperties": False, "required": ["mode"],
            "properties": {
                "mode": {"enum": ["bundled", "external"]},
                "external": {"type": "object", "additionalProperties": False, "properties": {
                    "endpoints": {"type": "array", "items": {
                        "type": "string", "pattern": "^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:[0-9]{1,5}$",
                        "description": "host:port of an etcd member (no scheme)"}}}},
                "bundled": {"type": "object", "additionalProperties": False, "properties": {
                    "replicas": {"enum": [1, 3], "description": "1 (dev) or 3 (survives one member)"},
                    "image": {"type": "object", "additionalProperties": False,
                              "properties": {"repository": {"type": "string"}, "tag": {"type": "string"}}},
                    "persistence": {"type": "object", "additionalProperties": False, "properties": {
                        "enabled": {"type": "boolean"}, "size": {"type": "string"},
                        "storageClass": {"type": "string"}}},
                    "resources": obj,
                    "clientPeers": peers}}},
            "if": {"properties": {"mode": {"const": "external"}}},
            "then": {"required": ["external"], "properties": {"external": {
                "required": ["endpoints"], "properties": {"endpoints": {"minItems": 1}}}}}},
        "modelStorage": {"type": "object", "additionalProperties": False, "properties": {
            "mountPath": {"type": "string", "pattern": "^/"},
            "volume": {"type": "object", "maxProperties": 1,
                       "description": "one Kubernetes volume source, or empty for an emptyDir"}}},
        "config": {"type": "object", "additionalProperties": {
            "type": ["string", "number", "boolean"],
            "description": "shared top-level scalars; per-service sections go in services.<name>.config"}},
        "gpu": {"type": "object", "additionalProperties": False, "properties": {
            "resourceName": {"type": "string", "minLength": 1},
            "perNode": {"type": "integer", "minimum": 1}}},
        "ports": {"type": "object", "additionalProperties": False, "properties": {
            k: {"type": "integer", "minimum": 1, "maximum": 65535} for k in ("grpc", "metrics", "http")}},
        "metrics": {"type": "object", "additionalProperties": False,
                    "properties": {"scrapeAnnotations": {"type": "boolean"}}},
        "networkPolicy": {"type": "object", "additionalProperties": False, "properties": {
            "enabled": {"type": "boolean"},
            "clientPeers": peers, "controlPlanePeers": peers,
            "monitoringNamespace": {"type": "string", "minLength": 1},
            "callers": {"type": "object", "additionalProperties": False, "properties": {
                s: {"type": "array", "items": {"enum": SERVICES}} for s in SERVICES}}}},
        "operator": {"type": "object", "additionalProperties": False, "properties": {
            "serviceAccount": {"type": "object", "additionalProperties": False, "properties": {
                "create": {"type": "boolean"}, "name": {"type": "string"}}},
            "rbac": {"type": "object", "additionalProperties": False, "properties": {
                "create": {"type": "boolean"}, "drills": {"type": "boolean"}}}}},
        "serviceDefaults": {"$ref": "#/$defs/serviceSpec"},
        "services": {"type": "object", "additionalProperties": False,
                     "properties": {s: {"$ref": "#/$defs/serviceSpec"} for s in SERVICES}},
    }}
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "k3" / "values.schema.json"


def render() -> str:
    return json.dumps(schema, indent=2) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
