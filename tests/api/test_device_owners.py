"""What the cluster overview reads from the device list: each device's owning component kind and
the groups that time-share it when a job places components on the same GPUs."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from jobs.models import Worker, WorkerState
from tests.factories import mark_running, submit
from tests.services import REPO_ROOT

pytestmark = pytest.mark.django_db


def devices(client: APIClient, **params: Any) -> list[dict[str, Any]]:
    response = client.get("/api/v1/devices/", {"page_size": 100, **params})
    assert response.status_code == 200, response.content
    found: list[dict[str, Any]] = response.json()["results"]
    return found


def test_a_device_names_its_owners_component_kind(
    clients: dict[str, APIClient], cluster: Any, users: dict[str, User]
) -> None:
    job = mark_running(submit(users["operator"]))
    owned = devices(clients["viewer"], job=job.pk)
    assert {(d["group"], d["group_kind"]) for d in owned} == {("rollout", "rollout"), ("actor", "actor")}
    assert all(d["shared_with"] == [] for d in owned)
    free = devices(clients["viewer"], status="free")
    assert free and all(d["group_kind"] is None and d["shared_with"] == [] for d in free)


def test_colocated_components_show_who_shares_a_device(
    clients: dict[str, APIClient], cluster: Any, users: dict[str, User]
) -> None:
    colocated = json.loads((REPO_ROOT / "examples" / "math-1.5b-colocated.json").read_text())
    job = mark_running(submit(users["operator"], colocated))
    on_job = devices(clients["viewer"], job=job.pk)
    assert len(on_job) == 8
    for device in on_job:
        # One group owns the device; the other components run on it too.
        assert device["group"] not in device["shared_with"]
        assert set(device["shared_with"]) | {device["group"]} == {"rollout", "reward", "actor"}

    # A worker that stopped no longer shares anything.
    Worker.objects.filter(group__job=job, group__name="reward").update(state=WorkerState.STOPPED)
    assert all("reward" not in d["shared_with"] for d in devices(clients["viewer"], job=job.pk))
