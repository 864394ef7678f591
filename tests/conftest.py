from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection

from tests.services import celery_process, wait_until

# The suite's Ray clusters are single-machine, on loopback: Ray reads this when it is imported
# (agents.backends.ray.connection.LOOPBACK_ENV says why), so it is set before any test imports it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

pytest_plugins = ["tests.ray_cluster"]


@pytest.fixture(scope="session")
def redis_reachable() -> None:
    """Fail early and clearly when the test broker is not there."""
    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.exit(f"Redis at REDIS_URL={settings.REDIS_URL} is not reachable: {exc}", returncode=3)


@pytest.fixture
def service_env(tmp_path: Path, redis_reachable: None) -> dict[str, str]:
    """Environment for child processes that must see the same database and broker as the test."""
    env = dict(os.environ)
    db = settings.DATABASES["default"]
    env["DATABASE_URL"] = (
        f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/"
        f"{connection.settings_dict['NAME']}"
    )
    env["REDIS_URL"] = settings.REDIS_URL
    env["DYNARL_DATA_DIR"] = str(tmp_path / "data")
    return env


@pytest.fixture
def celery_worker(service_env: dict[str, str], tmp_path: Path) -> Iterator[None]:
    from controlplane.celery import app

    with celery_process("worker", service_env, tmp_path):
        assert wait_until(lambda: bool(app.control.ping(timeout=0.5)), timeout_s=30), "worker did not start"
        yield


@pytest.fixture
def celery_beat(service_env: dict[str, str], tmp_path: Path) -> Iterator[None]:
    with celery_process("beat", service_env, tmp_path):
        yield
