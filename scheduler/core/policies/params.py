"""Declared, validated policy parameters.

Each policy lists its parameters as ``ParamSpec``s (name, default, type, bounds, meaning). Job specs
and the REST layer pass plain mappings; anything unknown or out of range raises
``PolicyParamError`` (a ``ValueError``) naming the parameter, which the REST layer turns into a 400.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ParamValue = float | int | bool


class PolicyParamError(ValueError):
    """A policy parameter (or the policy name itself) is unknown or invalid."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ParamSpec:
    name: str
    default: ParamValue
    doc: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False

    @property
    def type_name(self) -> str:
        return type(self.default).__name__

    def coerce(self, policy: str, value: Any) -> ParamValue:
        expected = type(self.default)
        if expected is bool:
            if not isinstance(value, bool):
                raise self._error(policy, f"must be true or false, got {value!r}")
            return value
        # bool is an int subclass; a flag where a number belongs is a spec mistake.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._error(policy, f"must be a number, got {value!r}")
        number: int | float
        if expected is int:
            if isinstance(value, float) and not value.is_integer():
                raise self._error(policy, f"must be an integer, got {value!r}")
            number = int(value)
        else:
            number = float(value)
            if not math.isfinite(number):
                raise self._error(policy, f"must be finite, got {value!r}")
        if self.minimum is not None:
            if self.exclusive_minimum and number <= self.minimum:
                raise self._error(policy, f"must be > {self.minimum}, got {value!r}")
            if number < self.minimum:
                raise self._error(policy, f"must be >= {self.minimum}, got {value!r}")
        if self.maximum is not None and number > self.maximum:
            raise self._error(policy, f"must be <= {self.maximum}, got {value!r}")
        return number

    def _error(self, policy: str, message: str) -> PolicyParamError:
        return PolicyParamError(self.name, f"policy {policy!r}: parameter {self.name!r} {message}")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type_name,
            "default": self.default,
            "minimum": self.minimum,
            "maximum": self.maximum,
            "doc": self.doc,
        }


def resolve_params(
    policy: str, specs: Sequence[ParamSpec], given: Mapping[str, Any] | None
) -> dict[str, ParamValue]:
    """Defaults overlaid with ``given``, every value validated."""
    by_name = {spec.name: spec for spec in specs}
    resolved: dict[str, ParamValue] = {spec.name: spec.default for spec in specs}
    for name, value in (given or {}).items():
        spec = by_name.get(name)
        if spec is None:
            known = ", ".join(sorted(by_name)) or "none"
            raise PolicyParamError(name, f"policy {policy!r}: unknown parameter {name!r} (known: {known})")
        resolved[name] = spec.coerce(policy, value)
    return resolved


def params_table(specs: Sequence[ParamSpec]) -> str:
    """The parameter table for a docstring or ``--help``."""
    lines = ["| parameter | default | meaning |", "| --- | --- | --- |"]
    lines.extend(f"| `{s.name}` | {s.default!r} | {s.doc} |" for s in specs)
    return "\n".join(lines)
