"""Bad values fail at install time with a message that names the value (schema or template check)."""

from __future__ import annotations

import re

import helm_python
import pytest

from helm.tools import values_schema
from tests.deploy.chart import MINIMAL, chart, render

BAD = [
    ({"services": {"decode": {"tensorParallel": 3}}}, r"/services/decode/tensorParallel"),
    ({"services": {"decode": {"replicas": -1}}}, r"/services/decode/replicas"),
    ({"services": {"decoder": {"replicas": 1}}}, r"additional properties 'decoder' not allowed"),
    ({"services": {"gateway": {"replica": 2}}}, r"additional properties 'replica' not allowed"),
    ({"services": {"decode": {"rollingUpdate": {"maxUnavailable": 1}}}},
     r"/services/decode/rollingUpdate/maxUnavailable"),
    ({"etcd": {"mode": "managed"}}, r"/etcd/mode"),
    ({"etcd": {"mode": "external"}}, r"/etcd/external/endpoints"),
    ({"etcd": {"mode": "external", "external": {"endpoints": ["https://etcd:2379"]}}},
     r"/etcd/external/endpoints/0"),
    ({"etcd": {"bundled": {"replicas": 2}}}, r"/etcd/bundled/replicas"),
    ({"cluster": {"name": "US_East"}}, r"/cluster/name"),
    ({"cluster": {"role": "worker"}}, r"/cluster/role"),
    ({"image": {"tag": "latest"}}, r"/image/tag"),
    ({"auth": {"token": "short"}}, r"/auth/token"),
    ({"config": {"gateway": {"http_port": 1}}}, r"/config/gateway"),
    ({"services": {"decode": {"env": {"max-batch": 1}}}}, r"/services/decode/env.*'max-batch' not allowed"),
    ({"services": {"decode": {"autoscaling": {"metrics": [{"type": "Pods", "name": "q"}]}}}},
     r"/services/decode/autoscaling/metrics/0"),
    ({"services": {"decode": {"autoscaling": {"metrics": [
        {"type": "Pods", "name": "q", "averageValue": "1", "perCluster": True}]}}}},
     r"/services/decode/autoscaling/metrics/0"),
]

TEMPLATE_CHECKS = [
    ({"services": {"decode": {"tensorParallel": 16}}},
     r"services\.decode\.tensorParallel \(16\) exceeds gpu\.perNode \(8\)"),
    ({"services": {"prefill": {"image": "controlPlane"}}}, r"services\.prefill\.gpu is true"),
    ({"services": {"router": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}},
     r"services\.router\.autoscaling\.minReplicas \(5\) is above maxReplicas \(2\)"),
    ({"services": {"router": {"autoscaling": {"cpuUtilization": 0}}}}, r"services\.router\.autoscaling"),
    ({"etcd": {"bundled": {"replicas": 3, "persistence": {"enabled": False}}}},
     r"etcd\.bundled\.replicas is 3 but etcd\.bundled\.persistence\.enabled is false"),
]


@pytest.mark.parametrize("values,message", BAD, ids=[m for _, m in BAD])
def test_schema_rejects_with_the_value_path(values, message):
    with pytest.raises(helm_python.HelmValuesError) as info:
        render({**MINIMAL, **values})
    assert re.search(message, str(info.value)), str(info.value)


@pytest.mark.parametrize("values,message", TEMPLATE_CHECKS, ids=[m for _, m in TEMPLATE_CHECKS])
def test_template_checks_name_the_value(values, message):
    with pytest.raises(helm_python.HelmRenderError) as info:
        render({**MINIMAL, **values})
    assert re.search(message, str(info.value)), str(info.value)


def test_missing_token_says_how_to_fix_it():
    with pytest.raises(helm_python.HelmRenderError, match=r"auth\.existingSecret .* or auth\.token"):
        render({})
    assert render({"auth": {"existingSecret": "shared"}})


def test_defaults_and_minimal_values_pass_the_schema():
    chart().validate_schema(MINIMAL)


def test_committed_schema_matches_its_generator():
    committed = (values_schema.SCHEMA_PATH).read_text()
    assert committed == values_schema.render(), "run: python helm/tools/values_schema.py"
