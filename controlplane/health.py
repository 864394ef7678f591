"""Service checks behind /healthz: the database, the broker, the Celery workers and beat, and
under the run command the processes its supervisor keeps running."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import redis
from django.conf import settings
from django.db import connection

from common import redis as common_redis
from controlplane.celery import app
from controlplane.supervise import RESTARTING, RUNNING, read_status

BEAT_KEY = "dynarl:health:beat"


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    latency_ms: float
    extra: dict[str, Any] = field(default_factory=dict)  # more of the check's findings, for machines

    def to_json(self) -> dict[str, object]:
        return {"ok": self.ok, "detail": self.detail, "latency_ms": round(self.latency_ms, 1), **self.extra}


def _redis_client() -> redis.Redis:
    return common_redis.client_with_timeout(1.0)


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


def _describe_process(name: str, process: dict[str, Any], now: float) -> str:
    restarts = int(process.get("restarts") or 0)
    if process.get("state") == RESTARTING:
        next_at = process.get("next_attempt_at")
        when = f", next in {max(0.0, float(next_at) - now):.1f}s" if next_at is not None else ""
        return f"{name} restarting (attempt {process.get('attempt')}, {process.get('last_exit')}{when})"
    if restarts:
        return f"{name} {process.get('state')} (restarted {restarts}x, last {process.get('last_exit')})"
    return f"{name} {process.get('state')}"


def check_processes(status_file: str) -> CheckResult:
    """The run command's processes: failing while any is not running (restarting after a crash)."""
    processes: dict[str, Any] = {}

    def run() -> str:
        status = read_status(Path(status_file))
        pid = status.get("supervisor_pid")
        if not isinstance(pid, int) or not psutil.pid_exists(pid):
            raise RuntimeError(f"the run command's supervisor (pid {pid}) is not running")
        processes.update(status["processes"])
        now = time.time()
        described = {name: _describe_process(name, p, now) for name, p in processes.items()}
        down = [text for name, text in described.items() if processes[name].get("state") != RUNNING]
        if down:
            raise RuntimeError("; ".join(down))
        return ", ".join(described.values())

    result = _timed("processes", run)
    return replace(result, extra={"processes": processes})


def mark_beat() -> None:
    _redis_client().set(BEAT_KEY, str(time.time()))


def run_checks() -> list[CheckResult]:
    results = [check_database(), check_broker(), check_workers(), check_beat()]
    if settings.SUPERVISOR_STATUS_FILE:
        results.append(check_processes(settings.SUPERVISOR_STATUS_FILE))
    return results
