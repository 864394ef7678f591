"""The policy a spec names, checked against the policy registry: unknown names, and each parameter
the policy refuses, reported at the key the format sets it with."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jobs.spec.errors import Problems
from jobs.spec.values import describe, is_number, shown, suggestion
from scheduler.core.costs import MigrationCostModel
from scheduler.core.policies import POLICY_NAMES, build_policy
from scheduler.core.predictor import ThroughputPredictor


@dataclass(frozen=True)
class PolicyRegistry:
    names: tuple[str, ...]
    # None when only the names are known: parameters are then only checked to be numbers or booleans.
    build: Callable[..., object] | None


def policy_registry() -> PolicyRegistry:
    """The policies a spec may name and how one is built (looked up at each check, so a test can
    stand in another registry)."""
    return PolicyRegistry(POLICY_NAMES, build_policy)


def check_policy(
    name: str | None,
    params: Mapping[str, Any] | None,
    *,
    model_params_b: float | None,
    problems: Problems,
    name_path: str,
    param_path: Callable[[str], str],
    params_path: str,
) -> None:
    """Unknown names at ``name_path``; a parameter the policy refuses at ``param_path(param)``."""
    registry = policy_registry()
    if name is None:
        return
    if name not in registry.names:
        problems.add(
            name_path,
            f"unknown policy {shown(name)}{suggestion(name, registry.names)} (known: {', '.join(registry.names)})",
        )
        return
    if params is None:
        return
    if registry.build is None:
        for key, value in params.items():
            if not (isinstance(value, bool) or is_number(value)):
                problems.add(param_path(key), f"must be a number or true/false, got {describe(value)}")
        return
    # Only the parameters are being checked; a nominal size stands in for an invalid model size.
    cost_model = MigrationCostModel(model_params_b=model_params_b if model_params_b is not None else 1.0)
    build = registry.build

    def refused(given: Mapping[str, Any]) -> bool:
        try:
            build(name, predictor=ThroughputPredictor(), cost_model=cost_model, params=dict(given))
        except ValueError as exc:
            param = getattr(exc, "param", None)
            path = param_path(param) if isinstance(param, str) and param in given else params_path
            problems.add(path, str(exc))
            return True
        return False

    # One parameter at a time so every bad one is named (the policy stops at its first), then all
    # together for constraints between them.
    if not any([refused({key: value}) for key, value in params.items()]):
        refused(params)
