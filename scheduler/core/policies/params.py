"""Declared, validated policy parameters.

Each policy lists its parameters as ``ParamSpec``s (name, default, type, bounds, meaning). Job specs
and the REST layer pass plain mappings; anything unknown or out of range raises
``PolicyParamError`` (a ``ValueError``) naming the parameter, which the REST layer turns into a 400.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ParamValue = float | int | bool

# Values quoted in errors are cut short: a spec may give a parameter a structure that a YAML alias
# chain repeats a billion times, and its full repr() would never end.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlong = 40
_SHORT.maxlevel = 2
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


def _shown(value: object) -> str:
    return _SHORT.repr(value)


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
                raise self._error(policy, f"must be true or false, got {_shown(value)}")
            return value
        # bool is an int subclass; a flag where a number belongs is a spec mistake.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._error(policy, f"must be a number, got {_shown(value)}")
        number: int | float
        if expected is int:
            if isinstance(value, float) and not value.is_integer():
                raise self._error(policy, f"must be an integer, got {_shown(value)}")
            number = int(value)
        else:
            try:
                number = float(value)
            except OverflowError:  # an integer past 10**308
                raise self._error(policy, f"must be finite, got {_shown(value)}") from None
            if not math.isfinite(number):
                raise self._error(policy, f"must be finite, got {_shown(value)}")
        if self.minimum is not None:
            if self.exclusive_minimum and number <= self.minimum:
                raise self._error(policy, f"must be > {self.minimum}, got {_shown(value)}")
            if number < self.minimum:
                raise self._error(policy, f"must be >= {self.minimum}, got {_shown(value)}")
        if self.maximum is not None and number > self.maximum:
            raise self._error(policy, f"must be <= {self.maximum}, got {_shown(value)}")
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
            raise PolicyParamError(
                name, f"policy {policy!r}: unknown parameter {_shown(name)} (known: {known})"
            )
        resolved[name] = spec.coerce(policy, value)
    return resolved


def params_table(specs: Sequence[ParamSpec]) -> str:
    """The parameter table for a docstring or ``--help``."""
    lines = ["| parameter | default | meaning |", "| --- | --- | --- |"]
    lines.extend(f"| `{s.name}` | {s.default!r} | {s.doc} |" for s in specs)
    return "\n".join(lines)
