"""Every endpoint x every role: viewers read, operators also steer jobs, admins also manage
everyone's tokens; anonymous callers get 401 everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from common.audit import Actor
from common.models import ApiToken, AuditEvent
from jobs import services
from jobs.models import Job, JobState
from scheduler.models import Migration
from tests.api.conftest import error_of
from tests.factories import spec

pytestmark = pytest.mark.django_db

ROLES = ("admin", "operator", "viewer", "anonymous")


def read_urls(history: dict[str, Any]) -> list[str]:
    from cluster.models import Device, Node
    from jobs.models import WorkerGroup

    job = history["job"]
    group = WorkerGroup.objects.filter(job=job).first()
    node, device, event = Node.objects.first(), Device.objects.first(), AuditEvent.objects.first()
    assert group is not None and node is not None and device is not None and event is not None
    return [
        "/api/v1/whoami/",
        "/api/v1/cluster/",
        "/api/v1/tokens/",
        "/api/v1/jobs/",
        f"/api/v1/jobs/{job.pk}/",
        f"/api/v1/worker-groups/?job={job.pk}",
        f"/api/v1/worker-groups/{group.pk}/",
        "/api/v1/nodes/",
        f"/api/v1/nodes/{node.pk}/",
        "/api/v1/devices/",
        f"/api/v1/devices/{device.pk}/",
        f"/api/v1/snapshots/?job={job.pk}",
        f"/api/v1/snapshots/{history['snapshots'][0].pk}/",
        f"/api/v1/snapshots/latest/?job={job.pk}",
        f"/api/v1/jobs/{job.pk}/timeline/",
        f"/api/v1/jobs/{job.pk}/telemetry/",
        f"/api/v1/decisions/?job={job.pk}",
        f"/api/v1/decisions/{history['decision'].pk}/",
        "/api/v1/migrations/",
        f"/api/v1/migrations/{history['migration'].pk}/",
        "/api/v1/migrations/export/?format=csv",
        "/api/v1/migrations/export/?format=json&rows=step",
        "/api/v1/predictor-samples/",
        f"/api/v1/predictor-samples/{history['samples'][0].pk}/",
        "/api/v1/predictor-samples/summary/",
        "/api/v1/ticks/",
        f"/api/v1/ticks/{history['tick'].pk}/",
        "/api/v1/alerts/",
        f"/api/v1/alerts/{history['alerts'][0].pk}/",
        "/api/v1/audit-events/",
        f"/api/v1/audit-events/{event.pk}/",
        "/api/v1/audit-events/export/",
    ]


@pytest.mark.parametrize("role", ROLES)
def test_reads(role: str, clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    for url in read_urls(history):
        response = clients[role].get(url)
        if role == "anonymous":
            assert response.status_code == 401, url
            assert error_of(response)["code"] == "not_authenticated"
        else:
            assert response.status_code == 200, (url, response.status_code)


# --- writes: each case gets a fresh running job -------------------------------------------------

Write = Callable[[APIClient, Job, dict[str, User]], Any]


def submit_job(client: APIClient, job: Job, users: dict[str, User]) -> Any:
    return client.post("/api/v1/jobs/", spec("another", rollout=1, actor=1), format="json")


def cancel(client: APIClient, job: Job, users: dict[str, User]) -> Any:
    return client.post(f"/api/v1/jobs/{job.pk}/cancel/", {}, format="json")


def pause(client: APIClient, job: Job, users: dict[str, User]) -> Any:
    return client.post(f"/api/v1/jobs/{job.pk}/pause/", {}, format="json")


def resume(client: APIClient, job: Job, users: dict[str, User]) -> Any:
    return client.post(f"/api/v1/jobs/{job.pk}/resume/", {}, format="json")


def migrate(client: APIClient, job: Job, users: dict[str, User]) -> Any:
    body = {"donor": "rollout", "recipient": "actor", "workers": 1}
    return client.post(f"/api/v1/jobs/{job.pk}/migrate/", body, format="json")


JOB_WRITES: dict[str, tuple[Write, int]] = {
    "submit": (submit_job, 201),
    "cancel": (cancel, 200),
    "pause": (pause, 200),
    "resume": (resume, 200),
    "migrate": (migrate, 202),
}


def job_fingerprint() -> tuple[Any, ...]:
    """What a refused write must leave untouched."""
    return (
        list(Job.objects.order_by("pk").values_list("pk", "state")),
        Migration.objects.count(),
        AuditEvent.objects.filter(actor_type="user").count(),
    )


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("write", list(JOB_WRITES))
def test_job_writes(
    role: str, write: str, clients: dict[str, APIClient], running_job: Job, users: dict[str, User]
) -> None:
    call, success = JOB_WRITES[write]
    if write == "resume":  # only a paused job can resume
        services.pause_scheduling(running_job.pk, Actor.system("test"))
    if role in ("admin", "operator"):
        response = call(clients[role], running_job, users)
        assert response.status_code == success, response.content
        assert AuditEvent.objects.filter(actor=role, actor_type="user").exists()
        return
    before = job_fingerprint()
    response = call(clients[role], running_job, users)
    expected = 401 if role == "anonymous" else 403
    assert response.status_code == expected, response.content
    assert error_of(response)["code"] == ("not_authenticated" if role == "anonymous" else "permission_denied")
    if role == "viewer":
        assert "operator" in error_of(response)["message"]
    assert job_fingerprint() == before
    if write == "resume":
        assert Job.objects.get(pk=running_job.pk).state == JobState.PAUSED_SCHEDULING


@pytest.mark.parametrize("role", ROLES)
def test_token_writes(role: str, clients: dict[str, APIClient], users: dict[str, User]) -> None:
    created = clients[role].post("/api/v1/tokens/", {"name": "mine"}, format="json")
    if role == "anonymous":
        assert created.status_code == 401
        assert not ApiToken.objects.filter(name="mine").exists()
        return
    assert created.status_code == 201
    revoked = clients[role].post(f"/api/v1/tokens/{created.json()['id']}/revoke/", {}, format="json")
    assert revoked.status_code == 200
    # Someone else's token: only an admin may revoke it.
    others = ApiToken.objects.exclude(user=users[role]).first()
    assert others is not None
    response = clients[role].post(f"/api/v1/tokens/{others.pk}/revoke/", {}, format="json")
    assert response.status_code == (200 if role == "admin" else 404)
    others.refresh_from_db()
    assert (others.revoked_at is not None) == (role == "admin")


@pytest.mark.parametrize("method", ["put", "patch", "delete"])
def test_read_only_resources_refuse_changes(
    method: str, clients: dict[str, APIClient], history: dict[str, Any]
) -> None:
    for url in (
        f"/api/v1/migrations/{history['migration'].pk}/",
        f"/api/v1/snapshots/{history['snapshots'][0].pk}/",
        f"/api/v1/decisions/{history['decision'].pk}/",
        f"/api/v1/jobs/{history['job'].pk}/",
    ):
        response = getattr(clients["admin"], method)(url, {}, format="json")
        assert response.status_code == 405, url
