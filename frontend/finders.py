"""Serve plotly.js from the ``plotly`` Python package itself, so the dashboard needs no CDN.

Only ``plotly.min.js`` is exposed (as ``vendor/plotly.min.js``); the package's datasets and
templates stay out of collectstatic.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal, overload

from django.contrib.staticfiles.finders import BaseFinder
from django.core.files.storage import FileSystemStorage


def _plotly_dir() -> Path:
    # Located, not imported: importing plotly costs a second at every start.
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        raise RuntimeError("the plotly package is not installed")
    return Path(spec.origin).resolve().parent / "package_data"


PLOTLY_DIR = _plotly_dir()
PLOTLY_STATIC_PATH = "vendor/plotly.min.js"


class PlotlyFinder(BaseFinder):
    def check(self, **kwargs: Any) -> list[Any]:
        return []

    @overload
    def find(self, path: str, find_all: Literal[False] = False) -> str | None: ...
    @overload
    def find(self, path: str, find_all: Literal[True]) -> list[str]: ...
    def find(self, path: str, find_all: bool = False) -> str | list[str] | None:
        if path != PLOTLY_STATIC_PATH:
            return [] if find_all else None
        found = str(PLOTLY_DIR / "plotly.min.js")
        return [found] if find_all else found

    def list(self, ignore_patterns: Any) -> Any:
        # collectstatic copies storage.path(name) to prefix/name: a storage rooted at the package
        # with the prefix "vendor" makes the destination vendor/plotly.min.js.
        storage = FileSystemStorage(location=str(PLOTLY_DIR))
        storage.prefix = "vendor"  # type: ignore[attr-defined]
        yield "plotly.min.js", storage
