"""Request-body checks shared by the agent protocol's parsers (registration, command reports)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from scheduler.telemetry import FieldError


class InvalidPayload(ValueError):
    """A request body the protocol cannot accept; ``errors`` names every field at fault."""

    def __init__(self, errors: Iterable[FieldError]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{e.path}: {e.message}" for e in self.errors))


def json_object(payload: Any) -> Mapping[str, Any]:
    if not isinstance(payload, Mapping):
        raise InvalidPayload([FieldError("", "must be a JSON object")])
    return payload


def text_field(
    data: Mapping[str, Any],
    key: str,
    errors: list[FieldError],
    *,
    max_length: int,
    default: str | None = None,
) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        errors.append(
            FieldError(key, "must be a non-empty string" if default is None else "must be a string")
        )
        return ""
    if len(value) > max_length:
        errors.append(FieldError(key, f"must be at most {max_length} characters"))
    return value
