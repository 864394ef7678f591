import pytest

from scheduler.core.costs import MigrationCostModel
from scheduler.core.policies import (
    POLICY_CLASSES,
    POLICY_NAMES,
    Placement,
    PolicyParamError,
    build_policy,
    policy_params,
    policy_placement,
    validate_params,
)
from scheduler.core.predictor import ThroughputPredictor


def build(name: str, **params: object):
    return build_policy(
        name, predictor=ThroughputPredictor(), cost_model=MigrationCostModel(7.0), params=params
    )


def test_every_name_builds_its_policy():
    assert set(POLICY_NAMES) == set(POLICY_CLASSES)
    for name in POLICY_NAMES:
        policy = build(name)
        assert policy.name == name
        assert policy.placement is policy_placement(name)
        assert set(policy.params) == {spec.name for spec in policy_params(name)}


def test_placements():
    assert policy_placement("static-colocated") is Placement.COLOCATED
    assert all(
        policy_placement(n) is Placement.DISAGGREGATED for n in POLICY_NAMES if n != "static-colocated"
    )


def test_unknown_policy_names_the_policy_field():
    with pytest.raises(PolicyParamError) as caught:
        build("round-robin")
    assert caught.value.param == "policy"
    assert "round-robin" in str(caught.value) and "dynarl" in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_unknown_parameter_is_named():
    with pytest.raises(PolicyParamError) as caught:
        build("dynarl", u_lo=0.2)
    assert caught.value.param == "u_lo"
    assert "u_low" in str(caught.value)  # the known ones are listed


@pytest.mark.parametrize(
    "name, param, value, message",
    [
        ("dynarl", "u_low", 1.5, "<= 1.0"),
        ("dynarl", "u_low", "0.2", "must be a number"),
        ("dynarl", "cooldown_s", -1, ">= 0.0"),
        ("dynarl", "max_candidates", 2.5, "integer"),
        ("dynarl", "max_candidates", True, "must be a number"),
        ("dynarl", "default_horizon_s", 0, "> 0.0"),
        ("dynarl", "sustain_s", float("nan"), "finite"),
        ("rlinf-auto", "use_pre_process_policy", 1, "true or false"),
        ("bidirectional", "idle_fraction_threshold", -0.1, ">= 0.0"),
    ],
)
def test_bad_parameter_values_are_named(name: str, param: str, value: object, message: str) -> None:
    with pytest.raises(PolicyParamError, match=message) as caught:
        build(name, **{param: value})
    assert caught.value.param == param
    assert repr(param) in str(caught.value)


def test_params_are_resolved_with_defaults_and_coerced():
    resolved = validate_params("dynarl", {"u_low": 0.1, "max_candidates": 8.0, "cooldown_s": 5})
    assert resolved["u_low"] == 0.1
    assert resolved["max_candidates"] == 8 and isinstance(resolved["max_candidates"], int)
    assert resolved["cooldown_s"] == 5.0 and isinstance(resolved["cooldown_s"], float)
    assert resolved["low_fraction_threshold"] == 0.5
    assert (
        build("rlinf-auto", use_wait_before_last_iter_policy=False).params["use_wait_before_last_iter_policy"]
        is False
    )


def test_each_parameter_is_documented_with_its_default_in_the_policy_docstring():
    for name in POLICY_NAMES:
        doc = POLICY_CLASSES[name].__doc__ or ""
        for spec in policy_params(name):
            assert f"| `{spec.name}` | {spec.default!r} |" in doc, (name, spec.name)
            assert spec.doc and spec.to_json()["default"] == spec.default
