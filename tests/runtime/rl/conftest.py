"""One directory per test session for warm-start weights, so each configuration's supervised
warm start runs once however many tests start a job from it."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warm-start")
