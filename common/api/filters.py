"""The base of every list endpoint's query filters.

Multi-valued filters accept both repeated parameters and commas: ``?state=running&state=pending``
and ``?state=running,pending`` mean the same. Invalid values answer 400 naming the parameter.

Every filter set derives from ``ApiFilterSet``, whose form refuses what PostgreSQL cannot take in
a query, whatever the filter's type: a NUL character in a string (``text`` cannot hold one), an
integer outside ``bigint``, a time outside the years 1-9999 once in UTC. Times are handed to the
database in UTC: an ISO 8601 offset such as ``-22:21`` names an instant well enough, but
PostgreSQL refuses offsets of 16 hours or more in a literal.
"""

# mypy: disallow-subclassing-any=False
# (django_filters ships no type information; its base classes are Any.)

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import django_filters
from django import forms
from django.core.exceptions import ValidationError

BIGINT_MIN, BIGINT_MAX = -(2**63), 2**63 - 1


def storable(value: Any) -> Any:
    """``value`` as PostgreSQL can take it in a query (times in UTC), or ValidationError."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValidationError("must not contain NUL (\\x00) characters", code="null_characters")
        return value
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not BIGINT_MIN <= value <= BIGINT_MAX:
            raise ValidationError(f"must be between {BIGINT_MIN} and {BIGINT_MAX}", code="out_of_range")
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value
        try:
            return value.astimezone(UTC)
        except OverflowError:
            raise ValidationError(
                "out of range: in UTC it falls before year 1 or after year 9999", code="out_of_range"
            ) from None
    if isinstance(value, list | tuple):
        return type(value)(storable(item) for item in value)
    if isinstance(value, slice):
        return slice(storable(value.start), storable(value.stop), value.step)
    return value


class StorableQueryForm(forms.Form):
    """Checks every cleaned filter value with ``storable`` and names the parameter at fault."""

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        for name, value in list(cleaned.items()):
            try:
                cleaned[name] = storable(value)
            except ValidationError as exc:
                self.add_error(name, exc)
        return cleaned


class ApiFilterSet(django_filters.FilterSet):
    """The base of every filter set of the API (see the module docstring)."""

    def get_form_class(self) -> type[forms.Form]:
        form: type[forms.Form] = super().get_form_class()
        return type(form.__name__, (StorableQueryForm, form), {})


class StrictBooleanField(forms.NullBooleanField):
    """``true``/``false`` (or ``1``/``0``); blank means not given. Django's field (and its
    select widget) would read any other value as not given, so ``?open=maybe`` listed everything."""

    widget = forms.TextInput
    VALUES: dict[str, bool] = {"true": True, "1": True, "false": False, "0": False}

    def to_python(self, value: Any) -> bool | None:  # type: ignore[override]  # None: not given
        if value is None or value == "":
            return None
        if isinstance(value, bool):
            return value
        try:
            return self.VALUES[str(value).lower()]
        except KeyError:
            raise ValidationError("must be true or false", code="invalid") from None

    def validate(self, value: bool | None) -> None:
        pass


class BooleanFilter(django_filters.BooleanFilter):
    field_class = StrictBooleanField


class CommaMultipleChoiceField(forms.MultipleChoiceField):
    def to_python(self, value: Any) -> list[str]:
        values: list[str] = super().to_python(value)
        return [part.strip() for item in values for part in item.split(",") if part.strip()]


class MultiChoiceFilter(django_filters.MultipleChoiceFilter):
    """One or more of the choices, OR-ed."""

    field_class = CommaMultipleChoiceField


class IdFilter(django_filters.NumberFilter):
    """A row id: a whole number that fits a ``bigint`` (``?job=1.5`` is a 400, not job 1)."""

    field_class = forms.IntegerField

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("min_value", BIGINT_MIN)
        kwargs.setdefault("max_value", BIGINT_MAX)
        super().__init__(*args, **kwargs)


class CharInFilter(django_filters.BaseInFilter, django_filters.CharFilter):
    """Comma-separated values, OR-ed: ``?verb=job.submit,job.cancelled``."""


def time_range(field_name: str, what: str) -> tuple[django_filters.IsoDateTimeFilter, ...]:
    """``after`` (inclusive) and ``before`` (exclusive) bounds on ``field_name``, ISO 8601."""
    return (
        django_filters.IsoDateTimeFilter(
            field_name=field_name, lookup_expr="gte", label=f"{what} at or after this time (ISO 8601)"
        ),
        django_filters.IsoDateTimeFilter(
            field_name=field_name, lookup_expr="lt", label=f"{what} before this time (ISO 8601)"
        ),
    )
