from __future__ import annotations

import pytest
import redis
from django.conf import settings
from django.test import Client

from controlplane import health
from tests.services import wait_until

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
