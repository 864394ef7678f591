"""The scheduling policies and their registry.

``build_policy(name, predictor=..., cost_model=..., params=...)`` is what the simulator and the
scheduling tick call. Unknown names or parameters raise ``PolicyParamError`` (a ``ValueError``)
whose ``param`` names the field at fault (``"policy"`` for the name).

| name | placement | what it does |
| --- | --- | --- |
| `dynarl` | disaggregated | DynaRL's Algorithm 1: shrink drained dynamic groups for the bottleneck |
| `static-colocated` | colocated | verl-like: all components time-share all GPUs, nothing moves |
| `static-disaggregated` | disaggregated | fixed split (RLinf / AReaL), nothing moves |
| `rlinf-auto` | disaggregated | RLinf's auto scheduler: release unneeded rollout instances to the actor |
| `bidirectional` | disaggregated | BiDiRL: balanced split, the bottleneck borrows the other pool's idle GPUs |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler.core.costs import MigrationCostModel
from scheduler.core.policies.base import BasePolicy, Placement, SchedulingPolicy
from scheduler.core.policies.bidirectional import BidirectionalPolicy
from scheduler.core.policies.dynarl import DynaRLPolicy
from scheduler.core.policies.params import ParamSpec, PolicyParamError, resolve_params
from scheduler.core.policies.rlinf_auto import RLinfAutoPolicy
from scheduler.core.policies.static import StaticColocatedPolicy, StaticDisaggregatedPolicy
from scheduler.core.predictor import ThroughputPredictor

POLICY_NAMES: tuple[str, ...] = (
    "dynarl",
    "static-colocated",
    "static-disaggregated",
    "rlinf-auto",
    "bidirectional",
)

POLICY_CLASSES: Mapping[str, type[BasePolicy]] = {
    cls.name: cls
    for cls in (
        DynaRLPolicy,
        StaticColocatedPolicy,
        StaticDisaggregatedPolicy,
        RLinfAutoPolicy,
        BidirectionalPolicy,
    )
}


def _policy_class(name: str) -> type[BasePolicy]:
    cls = POLICY_CLASSES.get(name)
    if cls is None:
        raise PolicyParamError("policy", f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    return cls


def build_policy(
    name: str,
    *,
    predictor: ThroughputPredictor,
    cost_model: MigrationCostModel,
    params: Mapping[str, Any] | None = None,
) -> SchedulingPolicy:
    """A fresh policy instance for one job."""
    return _policy_class(name)(predictor=predictor, cost_model=cost_model, params=params)


def policy_params(name: str) -> tuple[ParamSpec, ...]:
    """The parameters a policy accepts, with defaults and meanings (for forms and validation)."""
    return _policy_class(name).PARAMS


def policy_placement(name: str) -> Placement:
    return _policy_class(name).placement


def validate_params(name: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The resolved parameters (defaults filled in), or ``PolicyParamError`` naming the field."""
    return resolve_params(name, _policy_class(name).PARAMS, params)


__all__ = [
    "POLICY_CLASSES",
    "POLICY_NAMES",
    "BasePolicy",
    "BidirectionalPolicy",
    "DynaRLPolicy",
    "ParamSpec",
    "Placement",
    "PolicyParamError",
    "RLinfAutoPolicy",
    "SchedulingPolicy",
    "StaticColocatedPolicy",
    "StaticDisaggregatedPolicy",
    "build_policy",
    "policy_params",
    "policy_placement",
    "validate_params",
]
