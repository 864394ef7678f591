"""Fixtures for the REST API tests: users with each role and their token-authenticated clients,
and a cluster with a running job whose history holds one of every kind of row the API shows."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from cluster.models import AgentCommand, CommandState, Node
from common.audit import Actor
from common.models import ApiToken
from controlplane.asgi import application
from jobs.models import Job
from scheduler.models import (
    Alert,
    AlertKind,
    MigrationState,
    PredictorSample,
    PredictorScope,
    Tick,
)
from scheduler.services import gpu_migrations, snapshots
from tests.factories import make_cluster, make_user, mark_running, spec, submit

ROLES = ("admin", "operator", "viewer")


def bearer(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.fixture
def users(db: Any) -> dict[str, User]:
    return {role: make_user(role, role) for role in ROLES}


@pytest.fixture
def clients(users: dict[str, User]) -> dict[str, APIClient]:
    """A token-authenticated client per role, plus ``anonymous``."""
    made = {role: bearer(ApiToken.issue(user, f"{role} cli")[1]) for role, user in users.items()}
    made["anonymous"] = APIClient()
    return made


@pytest.fixture
def asgi_app(transactional_db: None, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The ASGI app (as daphne serves it) for clients that call it in-process, such as
    schemathesis's. Each request runs in a thread of its own with its own database connection,
    so the test's rows must be committed, and each connection is closed when its request ends
    (a lingering one would keep the test database from being dropped)."""
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 0)
    return application


@pytest.fixture
def cluster(db: Any) -> list[Node]:
    return make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4), "node-c": ("A100", 2)})


def play_agents() -> None:
    """Answer every queued migration-step command with success until none is left (what the
    node agents do)."""
    for _ in range(200):
        queued = list(
            AgentCommand.objects.filter(kind="migration_step", state=CommandState.QUEUED).select_related(
                "node"
            )
        )
        if not queued:
            return
        for command in queued:
            command.state = CommandState.DELIVERED
            command.save(update_fields=["state"])
            gpu_migrations.report_step(
                command.node, command.payload["step"]["step_id"], ok=True, attempt=command.payload["attempt"]
            )
    raise AssertionError("migration did not settle")


@pytest.fixture
def running_job(cluster: list[Node], users: dict[str, User]) -> Job:
    return mark_running(submit(users["operator"], spec("math-small", rollout=4, actor=2)))


def build_history(job: Job, operator: User) -> dict[str, Any]:
    """A committed manual migration (decision, steps), snapshots, predictor samples, a tick and
    alerts for a running ``job``."""
    first = snapshots.take(job, cause="admission")
    migration = gpu_migrations.request_manual_migration(
        job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(operator)
    )
    play_agents()
    migration.refresh_from_db()
    assert migration.state == MigrationState.COMMITTED
    second = snapshots.take(job, cause="migration")
    now = timezone.now()
    samples = [
        PredictorSample.objects.create(
            migration=migration, job=job, scope=PredictorScope.DONOR, group="rollout",
            component="rollout", predicted=90.0, observed=100.0, recorded_at=now,
        ),
        PredictorSample.objects.create(
            migration=migration, job=job, scope=PredictorScope.RECIPIENT, group="actor",
            component="actor", predicted=130.0, observed=100.0, recorded_at=now,
        ),
        PredictorSample.objects.create(
            migration=migration, job=job, scope=PredictorScope.JOB, group="",
            component="", predicted=50.0, observed=0.0, recorded_at=now,
        ),
    ]  # fmt: skip
    tick = Tick.objects.create(
        job=job,
        outcome="no_change",
        duration_ms=12.5,
        policy_ms=3.0,
        note="no group is idle enough to lend its GPUs",
    )
    open_alert = Alert.objects.create(
        kind=AlertKind.WORKER_STUCK, subject="w1", job=job, message="stuck at 0%"
    )
    cleared_alert = Alert.objects.create(
        kind=AlertKind.HEARTBEAT_GAP,
        subject="node-c",
        node=Node.objects.get(name="node-c"),
        message="no heartbeat for 30 s",
        raised_at=now - timedelta(minutes=5),
        cleared_at=now - timedelta(minutes=4),
    )
    return {
        "job": job,
        "migration": migration,
        "decision": migration.decision,
        "snapshots": [first, second],
        "samples": samples,
        "tick": tick,
        "alerts": [open_alert, cleared_alert],
    }


@pytest.fixture
def history(running_job: Job, users: dict[str, User]) -> dict[str, Any]:
    """``build_history`` for ``running_job``."""
    return build_history(running_job, users["operator"])


def error_of(response: Any) -> dict[str, Any]:
    """The ``error`` object of an API error answer, after checking the shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"status", "code", "message", "fields", "request_id"}, error
    assert error["status"] == response.status_code
    assert error["request_id"] == response["X-Request-ID"]
    return error


def field_paths(response: Any) -> list[str]:
    return [f["path"] for f in error_of(response)["fields"]]
