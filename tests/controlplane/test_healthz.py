from __future__ import annotations

from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.test import Client

from controlplane import health
from tests.services import SLEEPER, python, supervising, wait_until

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_stale_beat_mark() -> None:
    redis.Redis.from_url(settings.REDIS_URL).delete(health.BEAT_KEY)


def test_healthz_is_ok_when_database_broker_workers_and_beat_answer(
    client: Client, celery_worker: None, celery_beat: None
) -> None:
    assert wait_until(lambda: client.get("/healthz").status_code == 200, timeout_s=30)
    body = client.get("/healthz").json()
    assert body["status"] == "ok"
    assert body["failing"] == []
    assert set(body["checks"]) == {"database", "broker", "workers", "beat"}
    assert body["checks"]["database"]["detail"].startswith("PostgreSQL")


def test_healthz_names_the_workers_when_none_answers(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert "workers" in body["failing"]
    assert "beat" in body["failing"]
    assert body["checks"]["database"]["ok"] is True
    assert body["checks"]["broker"]["ok"] is True


def test_healthz_names_the_broker_when_redis_is_down(client: Client, settings: object) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # type: ignore[attr-defined]
    settings.CELERY_WORKER_PING_TIMEOUT = 0.2  # type: ignore[attr-defined]
    from controlplane.celery import app

    app.conf.broker_url = settings.REDIS_URL  # type: ignore[attr-defined]
    try:
        response = client.get("/healthz")
    finally:
        app.conf.broker_url = settings.CELERY_BROKER_URL  # type: ignore[attr-defined]
    assert response.status_code == 503
    assert "broker" in response.json()["failing"]
    assert response.json()["checks"]["database"]["ok"] is True


def test_healthz_only_answers_get(client: Client) -> None:
    assert client.post("/healthz").status_code == 405


def test_healthz_under_the_run_command_names_a_process_that_is_restarting(
    client: Client, settings: object, tmp_path: Path
) -> None:
    crasher = python("import sys; sys.exit(4)")
    with supervising(tmp_path, {"worker": crasher, "web": SLEEPER}, initial_s=600, max_s=600) as run:
        settings.SUPERVISOR_STATUS_FILE = str(run.status_path)  # type: ignore[attr-defined]
        assert wait_until(lambda: run.processes()["worker"]["state"] == "restarting", timeout_s=30)
        response = client.get("/healthz")
        assert response.status_code == 503
        body = response.json()
        assert "processes" in body["failing"]
        check = body["checks"]["processes"]
        assert check["ok"] is False
        assert "worker restarting (attempt 1, exit code 4, next in " in check["detail"]
        assert "web" not in check["detail"]  # only what is down is named
        assert check["processes"]["worker"]["state"] == "restarting"
        assert check["processes"]["web"]["state"] == "running"


def test_healthz_under_the_run_command_reports_running_processes(
    client: Client, settings: object, tmp_path: Path
) -> None:
    with supervising(tmp_path, {"web": SLEEPER, "beat": SLEEPER}) as run:
        settings.SUPERVISOR_STATUS_FILE = str(run.status_path)  # type: ignore[attr-defined]
        body = client.get("/healthz").json()
        assert "processes" not in body["failing"]
        assert body["checks"]["processes"]["ok"] is True
        assert body["checks"]["processes"]["detail"] == "web running, beat running"
        pids = {name: p["pid"] for name, p in body["checks"]["processes"]["processes"].items()}
        assert pids == {name: p["pid"] for name, p in run.processes().items()}
    # Its supervisor gone, the states it left (none: it removes its file) are not trusted.
    response = client.get("/healthz")
    assert response.status_code == 503
    assert "processes" in response.json()["failing"]


def test_healthz_without_the_run_command_has_no_process_check(client: Client, settings: object) -> None:
    settings.SUPERVISOR_STATUS_FILE = None  # type: ignore[attr-defined]
    assert "processes" not in client.get("/healthz").json()["checks"]
