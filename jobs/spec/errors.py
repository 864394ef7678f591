"""What a spec's problems are reported as: ``FieldError`` (one problem at one key path),
``SpecError`` (every problem of a spec), ``RankError`` (a rank list that cannot be expanded) and
``Problems``, which collects them while a spec is read."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

# At most this many problems are listed; the rest are counted.
MAX_REPORTED_PROBLEMS: Final = 50
# Backstop for what a problem may quote: a path is built from keys the user wrote, a message may
# quote a value; neither may grow with the document.
MAX_PATH_CHARS: Final = 300
MAX_MESSAGE_CHARS: Final = 1000


@dataclass(frozen=True)
class FieldError:
    """One problem, at one key path (``""`` is the document itself); both are cut to a bounded
    length."""

    path: str
    message: str

    def __post_init__(self) -> None:
        if len(self.path) > MAX_PATH_CHARS:
            object.__setattr__(self, "path", self.path[: MAX_PATH_CHARS - 3] + "...")
        if len(self.message) > MAX_MESSAGE_CHARS:
            object.__setattr__(self, "message", self.message[: MAX_MESSAGE_CHARS - 3] + "...")

    def __str__(self) -> str:
        return f"{self.path or '(document)'}: {self.message}"

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


class SpecError(ValueError):
    """A job spec that cannot be accepted; ``errors`` holds every problem found, not just the first
    (beyond ``MAX_REPORTED_PROBLEMS``, one last entry counts the rest)."""

    def __init__(self, errors: Iterable[FieldError]) -> None:
        self.errors: list[FieldError] = list(errors)
        if len(self.errors) > MAX_REPORTED_PROBLEMS:
            # A document of thousands of bad keys must not make an answer of thousands of lines.
            hidden = len(self.errors) - MAX_REPORTED_PROBLEMS
            self.errors = [
                *self.errors[:MAX_REPORTED_PROBLEMS],
                FieldError("", f"and {hidden} more problems not listed"),
            ]
        count = len(self.errors)
        lines = "\n".join(f"  {error}" for error in self.errors)
        super().__init__(f"invalid job spec ({count} problem{'s' if count != 1 else ''}):\n{lines}")

    @property
    def paths(self) -> list[str]:
        return [error.path for error in self.errors]

    def to_json(self) -> list[dict[str, str]]:
        return [error.to_json() for error in self.errors]


class RankError(ValueError):
    """A GPU rank list (``"0-3"``, ``"0-1,4-5"``, ``"all"``) that cannot be expanded."""


class Problems:
    """Collects every problem; the spec is rejected at the end if there is any."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def add(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def __bool__(self) -> bool:
        return bool(self.errors)

    def raise_if_any(self) -> None:
        if self.errors:
            raise SpecError(self.errors)
