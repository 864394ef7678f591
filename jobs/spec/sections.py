"""Reading one mapping of a spec document with key paths: ``Section`` and its typed readers, used by
both formats. A reader reports a problem at the key's path and returns ``None``."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from jobs.spec.errors import Problems
from jobs.spec.values import describe, is_int, is_number, shown, suggestion

# Every integer of a spec either lands in a 32-bit column (iterations, tp, pp, worker counts) or is
# used with them; one past this is refused at its key rather than by the database.
INTEGER_MAX: Final = 2**31 - 1


class Marker:
    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return self.label


ABSENT: Final = Marker("<absent>")  # the key is not there
REPORTED: Final = Marker("<reported>")  # the value was bad and its problem is already recorded


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class Section:
    """One mapping of the document, where it sits (its key path) and typed readers for its keys.

    The readers report a problem at the key's path and return ``None``; callers treat ``None``
    from a required or bad key as "already reported" and skip checks that depend on it.
    """

    def __init__(self, data: Mapping[Any, Any], path: str, problems: Problems) -> None:
        self.data = data
        self.path = path
        self.problems = problems

    def path_of(self, key: str) -> str:
        return _join(self.path, key)

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> Any:
        """The value as written, or ``ABSENT``; a subclass may resolve references here."""
        return self.data.get(key, ABSENT)

    def peek(self, key: str) -> Any:
        """The value, or ``ABSENT`` when it is missing or cannot be read; records no problem."""
        return self.data.get(key, ABSENT)

    def fail(self, key: str, message: str) -> None:
        self.problems.add(self.path_of(key), message)

    def reject_unknown(self, allowed: Sequence[str]) -> None:
        for key in self.data:
            if not isinstance(key, str):
                self.problems.add(self.path, f"keys must be strings, got {describe(key)}")
            elif key not in allowed:
                self.fail(key, f"unknown key{suggestion(key, allowed)} (allowed: {', '.join(allowed)})")

    def _present(self, key: str, required: bool) -> Any:
        value = self.raw(key)
        if value is ABSENT and required:
            self.fail(key, "is required")
            return REPORTED
        return value

    def integer(
        self,
        key: str,
        default: int | None = None,
        *,
        required: bool = False,
        nullable: bool = False,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int | None:
        value = self._present(key, required)
        if value is ABSENT:
            return default
        if value is REPORTED or (value is None and nullable):
            return None
        return _check_integer(self, key, value, minimum, maximum)

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        required: bool = False,
        nullable: bool = False,
        minimum: float | None = None,
        above: float | None = None,
        maximum: float | None = None,
    ) -> float | None:
        value = self._present(key, required)
        if value is ABSENT:
            return default
        if value is REPORTED or (value is None and nullable):
            return None
        if not is_number(value):
            self.fail(key, f"must be a number, got {describe(value)}")
            return None
        try:
            number = float(value)
        except OverflowError:  # an integer past what a float holds (over 10**308)
            self.fail(key, f"must be a number a float can hold, got {shown(value)}")
            return None
        if above is not None and number <= above:
            self.fail(key, f"must be greater than {above:g}, got {shown(value)}")
            return None
        if minimum is not None and number < minimum:
            self.fail(key, f"must be at least {minimum:g}, got {shown(value)}")
            return None
        if maximum is not None and number > maximum:
            self.fail(key, f"must be at most {maximum:g}, got {shown(value)}")
            return None
        return number

    def boolean(self, key: str, default: bool | None = None, *, required: bool = False) -> bool | None:
        value = self._present(key, required)
        if value is ABSENT:
            return default
        if value is REPORTED:
            return None
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {describe(value)}")
            return None
        return value

    def string(
        self,
        key: str,
        default: str | None = None,
        *,
        required: bool = False,
        nullable: bool = False,
        choices: Sequence[str] | None = None,
        pattern: re.Pattern[str] | None = None,
        pattern_hint: str = "",
        max_length: int | None = None,
    ) -> str | None:
        value = self._present(key, required)
        if value is ABSENT:
            return default
        if value is REPORTED or (value is None and nullable):
            return None
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {describe(value)}")
            return None
        if choices is not None:
            if value not in choices:
                self.fail(
                    key,
                    f"must be one of {', '.join(choices)}; got {shown(value)}{suggestion(value, choices)}",
                )
                return None
            return value
        if not value:
            self.fail(key, "must not be empty")
            return None
        if max_length is not None and len(value) > max_length:
            self.fail(key, f"must be at most {max_length} characters, got {len(value)}")
            return None
        if pattern is not None and pattern.fullmatch(value) is None:
            self.fail(key, f"{pattern_hint}; got {shown(value)}")
            return None
        return value

    def child(self, data: Mapping[Any, Any], path: str) -> Section:
        """A nested section; a subclass carries its own context along."""
        return Section(data, path, self.problems)

    def mapping(self, key: str, *, required: bool = False) -> Section | None:
        value = self._present(key, required)
        if value is ABSENT or value is REPORTED:
            return None
        if not isinstance(value, Mapping):
            self.fail(key, f"must be a mapping, got {describe(value)}")
            return None
        return self.child(value, self.path_of(key))

    def sequence(self, key: str, *, required: bool = False) -> list[Any] | None:
        value = self._present(key, required)
        if value is ABSENT or value is REPORTED:
            return None
        if not isinstance(value, list | tuple):
            self.fail(key, f"must be a list, got {describe(value)}")
            return None
        return list(value)

    def string_list(
        self, key: str, *, item_pattern: re.Pattern[str] | None = None, item_hint: str = ""
    ) -> tuple[tuple[int, str], ...] | None:
        """(position, string) for each good entry; bad or repeated entries are reported."""
        items = self.sequence(key)
        if items is None:
            return None if self.has(key) else ()
        good: list[tuple[int, str]] = []
        seen: set[str] = set()
        for position, item in enumerate(items):
            item_path = f"{self.path_of(key)}[{position}]"
            if not isinstance(item, str) or not item:
                self.problems.add(item_path, f"must be a non-empty string, got {describe(item)}")
            elif item_pattern is not None and item_pattern.fullmatch(item) is None:
                self.problems.add(item_path, f"{item_hint}; got {shown(item)}")
            elif item in seen:
                self.problems.add(item_path, f"{shown(item)} is listed twice")
            else:
                seen.add(item)
                good.append((position, item))
        return tuple(good)


def _check_integer(
    section: Section, key: str, value: Any, minimum: int | None, maximum: int | None
) -> int | None:
    if not is_int(value):
        section.fail(key, f"must be an integer, got {describe(value)}")
        return None
    assert isinstance(value, int)
    if minimum is not None and value < minimum:
        section.fail(key, f"must be at least {minimum}, got {shown(value)}")
        return None
    # Unless told otherwise, what a 32-bit database column holds: 2**64 is a 400 here, not a 500
    # from PostgreSQL later.
    ceiling = INTEGER_MAX if maximum is None else maximum
    if value > ceiling:
        section.fail(key, f"must be at most {ceiling}, got {shown(value)}")
        return None
    return value
