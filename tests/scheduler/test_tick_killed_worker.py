"""A real Celery worker SIGKILLed while its tick task is inside the tick's transaction leaves no
partial rows and moves no device; a new worker's tick then decides normally.

To have the tick reliably in progress when the worker dies, the test holds a SHARE lock on the
agent command table from its own connection: the tick writes its Tick row (not yet finished), the
decision and the migration with its steps, then waits on that lock to queue the first step's
command for the agents. The test sees the worker's session wait behind its own, kills the
worker, and only then lets go.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from cluster.models import AgentCommand, Device
from common import redis as common_redis
from controlplane.celery import app
from jobs.models import Job
from scheduler.models import HypergraphSnapshot, Migration, MigrationStep, SchedulingDecision, Tick
from scheduler.tasks import run_tick
from tests.scheduler.test_tick import idle_rollout_busy_trainer_job, report
from tests.services import celery_process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _clean_window(redis_reachable: None) -> Iterator[None]:
    yield
    common_redis.shared_client().flushdb()


def fresh_telemetry(job: Job) -> None:
    """The last seconds of an idle rollout and a busy trainer, as the tick about to run reads them."""
    report(job, {"rollout": 0.02, "actor": 1.0}, {"rollout": 5, "actor": 800})


def devices() -> list[tuple[str, Any, str]]:
    return list(Device.objects.order_by("uid").values_list("uid", "worker_id", "status"))


def rows_of(job_id: int) -> dict[str, int]:
    return {
        "ticks": Tick.objects.filter(job_id=job_id).count(),
        "decisions": SchedulingDecision.objects.filter(job_id=job_id).count(),
        "migrations": Migration.objects.filter(job_id=job_id).count(),
        "steps": MigrationStep.objects.filter(migration__job_id=job_id).count(),
        "step commands": AgentCommand.objects.filter(payload__job=job_id, kind="migration_step").count(),
        "snapshots": HypergraphSnapshot.objects.filter(job_id=job_id).count(),
    }


def sessions_waiting_behind(holder: psycopg.Connection[Any]) -> list[int]:
    """Backends of this database waiting for a lock ``holder`` holds."""
    with holder.cursor() as cursor:  # its own connection may look while it holds the lock
        # The activity view is read once per transaction unless its snapshot is dropped.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pg_backend_pid() = ANY(pg_blocking_pids(pid))"
        )
        return [row[0] for row in cursor.fetchall()]


def session_gone(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return row is not None and row[0] == 0


def test_a_celery_worker_killed_inside_the_tick_leaves_nothing_and_the_next_worker_decides(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    job = idle_rollout_busy_trainer_job()
    before = devices()
    settings_dict = connection.settings_dict
    holder = psycopg.connect(
        host=settings_dict["HOST"] or "127.0.0.1",
        port=int(settings_dict["PORT"] or 5432),
        user=settings_dict["USER"],
        password=settings_dict["PASSWORD"] or None,
        dbname=settings_dict["NAME"],
    )
    try:
        with holder.cursor() as cursor:
            cursor.execute(f"LOCK TABLE {AgentCommand._meta.db_table} IN SHARE MODE")
        first_dir = tmp_path / "first"
        first_dir.mkdir()
        with celery_process("worker", service_env, first_dir) as worker:
            assert wait_until(lambda: bool(app.control.ping(timeout=0.5)), timeout_s=60), "no worker"
            fresh_telemetry(job)
            run_tick.delay(job.pk)
            assert wait_until(lambda: bool(sessions_waiting_behind(holder)), timeout_s=60), (
                f"the tick never queued a command: {list(Tick.objects.filter(job=job).values())}"
            )
            [waiting] = sessions_waiting_behind(holder)
            # The decision and its migration are written, inside the worker's open transaction.
            with holder.cursor() as cursor:
                cursor.execute("SELECT pg_stat_clear_snapshot()")
                cursor.execute(
                    "SELECT state, wait_event_type FROM pg_stat_activity WHERE pid = %s", [waiting]
                )
                assert cursor.fetchone() == ("active", "Lock")
            worker.send_signal(signal.SIGKILL)
            worker.wait(30)
        holder.rollback()  # the lock goes; the dead worker's session finds its client gone
        assert wait_until(lambda: session_gone(waiting), timeout_s=60)
    finally:
        holder.close()

    # PostgreSQL rolled the whole tick back: not one of its rows, no device moved.
    assert rows_of(job.pk) == dict.fromkeys(
        ("ticks", "decisions", "migrations", "steps", "step commands", "snapshots"), 0
    )
    assert devices() == before

    second_dir = tmp_path / "second"
    second_dir.mkdir()
    with celery_process("worker", service_env, second_dir):
        assert wait_until(lambda: bool(app.control.ping(timeout=0.5)), timeout_s=60), "no worker"
        fresh_telemetry(job)
        run_tick.delay(job.pk)
        assert wait_until(lambda: Tick.objects.filter(job=job).exists(), timeout_s=60)
    [tick] = Tick.objects.filter(job=job)
    assert tick.outcome == "decided" and tick.decision_count == 1 and tick.duration_ms > 0
    [decision] = SchedulingDecision.objects.filter(job=job)
    migration = Migration.objects.get(decision=decision)
    assert migration.steps.exists()
    assert AgentCommand.objects.filter(step__migration=migration).exists()
    assert HypergraphSnapshot.objects.filter(job=job).count() <= 1  # only if the allocation changed
    # Devices change owner only when a migration commits; this one has only started.
    assert devices() == before
