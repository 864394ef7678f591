"""A job's GPU ownership timeline and per-group telemetry over the REST API."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.models import Worker
from scheduler.models import TelemetrySample
from tests.api.conftest import error_of, field_paths

pytestmark = pytest.mark.django_db


def test_timeline_shows_the_migration_and_both_owners(
    clients: dict[str, APIClient], history: dict[str, Any]
) -> None:
    job, migration = history["job"], history["migration"]
    response = clients["viewer"].get(f"/api/v1/jobs/{job.pk}/timeline/")
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"job", "start", "end", "devices", "segments", "migrations"}
    assert body["job"] == job.pk
    (mark,) = body["migrations"]
    assert mark["migration_id"] == migration.migration_id and mark["state"] == "committed"
    assert mark["finished_at"] is not None
    for uid in migration.device_uids:
        groups = [s["group"] for s in body["segments"] if s["device"] == uid]
        assert groups == ["rollout", "actor"]
        ends = [s["end"] for s in body["segments"] if s["device"] == uid]
        assert ends[0] is not None and ends[1] is None
    assert {d["uid"] for d in body["devices"]} == {s["device"] for s in body["segments"]}


def test_telemetry_per_group(clients: dict[str, APIClient], running_job: Any) -> None:
    worker = Worker.objects.filter(group__job=running_job, group__name="actor").first()
    assert worker is not None
    start = timezone.now() - timedelta(seconds=40)
    TelemetrySample.objects.create(
        job=running_job, group="actor", worker=worker.name, bucket_start=start, samples=5,
        utilisation_mean=0.75, utilisation_min=0.5, tokens=400, queue_length=1, in_flight=2,
    )  # fmt: skip
    response = clients["viewer"].get(f"/api/v1/jobs/{running_job.pk}/telemetry/")
    assert response.status_code == 200
    body = response.json()
    groups = {g["group"]: g for g in body["groups"]}
    assert set(groups) == {"rollout", "actor"} and groups["rollout"]["points"] == []
    (point,) = groups["actor"]["points"]
    assert point["utilisation_mean"] == 0.75 and point["tokens_per_s"] == pytest.approx(40.0)
    assert point["workers"] == 1 and point["in_flight"] == 2

    later = (start + timedelta(seconds=1)).isoformat()
    newer = clients["viewer"].get(f"/api/v1/jobs/{running_job.pk}/telemetry/", {"since": later})
    assert newer.status_code == 200
    assert all(g["points"] == [] for g in newer.json()["groups"])


def test_bad_since_names_the_parameter(clients: dict[str, APIClient], running_job: Any) -> None:
    response = clients["viewer"].get(f"/api/v1/jobs/{running_job.pk}/telemetry/", {"since": "yesterday"})
    assert response.status_code == 400
    assert field_paths(response) == ["since"]


@pytest.mark.parametrize("what", ["timeline", "telemetry"])
def test_unknown_job_is_404(what: str, clients: dict[str, APIClient], running_job: Any) -> None:
    response = clients["viewer"].get(f"/api/v1/jobs/{running_job.pk + 1000}/{what}/")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


@pytest.mark.parametrize("what", ["timeline", "telemetry"])
def test_history_is_read_only(what: str, clients: dict[str, APIClient], running_job: Any) -> None:
    response = clients["admin"].post(f"/api/v1/jobs/{running_job.pk}/{what}/", {}, format="json")
    assert response.status_code == 405


def test_documented_in_the_schema(clients: dict[str, APIClient]) -> None:
    schema = clients["viewer"].get("/api/schema/", {"format": "json"}).json()
    timeline = schema["paths"]["/api/v1/jobs/{id}/timeline/"]["get"]
    telemetry = schema["paths"]["/api/v1/jobs/{id}/telemetry/"]["get"]
    assert "200" in timeline["responses"] and "404" in timeline["responses"]
    assert [p["name"] for p in telemetry["parameters"] if p["in"] == "query"] == ["since"]
