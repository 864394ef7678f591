"""Service checks behind /healthz: the database, the broker, the Celery workers and beat."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from django.conf import settings
from django.db import connection

BEAT_KEY = "dynarl:health:beat"


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    latency_ms: float

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, "detail": self.detail, "latency_ms": round(self.latency_ms, 1)}


def _redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1.0, socket_connect_timeout=1.0)


def _timed(name: str, check: object) -> CheckResult:
    started = time.perf_counter()
    try:
        detail = check()  # type: ignore[operator]
        ok = True
    except Exception as exc:  # a health check reports every failure, whatever its type
        detail, ok = f"{type(exc).__name__}: {exc}", False
    return CheckResult(name, ok, str(detail), (time.perf_counter() - started) * 1000)


def check_database() -> CheckResult:
    def run() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT version()")
            row = cursor.fetchone()
        return str(row[0]).split(" on ")[0] if row else "no answer"

    return _timed("database", run)


def check_broker() -> CheckResult:
    def run() -> str:
        client = _redis_client()
        client.ping()
        return "redis " + str(client.info("server").get("redis_version", "?"))

    return _timed("broker", run)


def check_workers() -> CheckResult:
    from controlplane.celery import app

    def run() -> str:
        replies = app.control.ping(timeout=settings.CELERY_WORKER_PING_TIMEOUT)
        if not replies:
            raise RuntimeError("no Celery worker answered")
        return ", ".join(sorted(name for reply in replies for name in reply))

    return _timed("workers", run)


def check_beat() -> CheckResult:
    def run() -> str:
        raw = _redis_client().get(BEAT_KEY)
        if raw is None:
            raise RuntimeError("Celery beat has not run yet")
        age = time.time() - float(raw)
        if age > settings.BEAT_STALE_AFTER_S:
            raise RuntimeError(f"Celery beat last ran {age:.0f}s ago")
        return f"last ran {age:.1f}s ago"

    return _timed("beat", run)


def mark_beat() -> None:
    _redis_client().set(BEAT_KEY, str(time.time()))


def run_checks() -> list[CheckResult]:
    return [check_database(), check_broker(), check_workers(), check_beat()]
