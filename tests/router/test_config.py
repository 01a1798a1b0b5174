"""Router and admission configuration: every bad field is named in one error."""

from __future__ import annotations

import pytest

from services.admission.config import DEFAULT_BUDGETS, AdmissionConfig
from services.router.config import RouterConfig
from services.runtime import ConfigError


def test_router_config_names_every_bad_field():
    with pytest.raises(ConfigError) as err:
        RouterConfig.load("router", ["--slot-bits", "99", "--required-instances", "gateway:1",
                                     "--cluster-weights", '{"a": -1}', "--probe-fanout", "0",
                                     "--placement-mode", "sticky", "--bounded-eps", "-0.1",
                                     "--session-idle-ttl-s", "60", "--assignment-lease-window-s", "61"], env={})
    for field in ("slot_bits", "required_instances", "cluster_weights", "probe_fanout", "placement_mode",
                  "bounded_eps", "assignment_lease_window_s"):
        assert field in str(err.value)


def test_router_defaults_to_the_stateless_mode():
    config = RouterConfig.load("router", [], env={})
    assert (config.placement_mode, config.bounded_eps) == ("stateless", 0.1) and not config.validate()
    config = RouterConfig.load("router", ["--placement-mode", "bounded"], env={"K3_ROUTER_BOUNDED_EPS": "0.05"})
    assert (config.placement_mode, config.bounded_eps) == ("bounded", 0.05)


def test_router_config_from_env_and_flags():
    config = RouterConfig.load("router", ["--failback-hold-s", "30"],
                               env={"K3_ROUTER_CLUSTER_WEIGHTS": '{"big": 2}', "K3_ROUTER_SLOT_BITS": "16"})
    assert (config.failback_hold_s, config.cluster_weights, config.slot_bits) == (30.0, {"big": 2}, 16)


def test_admission_config_validates_budgets_and_cost_model():
    with pytest.raises(ConfigError) as err:
        AdmissionConfig.load("admission", ["--budgets", '{"SHORT": -1}', "--cost-model", '{"x": 1}'], env={})
    assert "budgets" in str(err.value) and "cost_model" in str(err.value)
    config = AdmissionConfig.load("admission", ["--cost-model", '{"prefill_ms_per_token": 2}'], env={})
    assert config.model().prefill_ms_per_token == 2 and config.budgets == DEFAULT_BUDGETS
