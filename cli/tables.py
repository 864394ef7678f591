"""Plain-text tables and values for people (``--json`` gives machines the API's own JSON)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces; numbers right-aligned."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) for row in rows) for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]) for i, v in enumerate(values)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(headers)), *(line(row) for row in cells)])


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "-"
    return str(value)


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def when(value: str | None) -> str:
    """An API timestamp as ``YYYY-MM-DD HH:MM:SS`` in UTC."""
    at = parse_time(value)
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if at else "-"


def ago(value: str | None, now: datetime | None = None) -> str:
    at = parse_time(value)
    if at is None:
        return "never"
    seconds = max(0.0, ((now or datetime.now(UTC)) - at).total_seconds())
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"
