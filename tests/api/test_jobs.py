"""Jobs through the API: submission in every body format, spec errors by key path, idempotency,
lists with filters and pages, the detail with the current allocation, and steering."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.contrib.auth.models import User
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from cluster.models import Device, Node
from common.models import ApiToken, AuditEvent
from jobs.models import Job, JobState
from scheduler.models import Migration, MigrationState
from tests.api.conftest import bearer, error_of, field_paths, play_agents
from tests.factories import make_cluster, make_user, mark_running, spec, submit

pytestmark = pytest.mark.django_db
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# --- submission --------------------------------------------------------------------------------


def test_submit_a_json_spec(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    response = clients["operator"].post(
        "/api/v1/jobs/", spec("math-json"), format="json", HTTP_X_REQUEST_ID="submit-1"
    )
    assert response.status_code == 201, response.content
    job = response.json()
    assert response["Location"].endswith(f"/api/v1/jobs/{job['id']}/")
    assert (job["name"], job["owner"], job["policy"], job["spec_format"]) == (
        "math-json",
        "operator",
        "dynarl",
        "dynarl",
    )
    # It fit, so it was admitted at once, all its groups with devices.
    assert job["state"] == "admitted"
    assert job["total_gpus"] == job["allocated_gpus"] == 6
    assert {g["name"]: g["gpus"] for g in job["groups"]} == {"rollout": 4, "actor": 2}
    assert [t["to_state"] for t in job["transitions"]] == ["pending", "admitted"]
    event = AuditEvent.objects.get(verb="job.submit", job_id=job["id"])
    assert (event.actor, event.actor_type, event.request_id) == ("operator", "user", "submit-1")


@pytest.mark.parametrize("content_type", ["application/yaml", "text/yaml", "application/x-yaml"])
def test_submit_a_yaml_body(clients: dict[str, APIClient], cluster: list[Node], content_type: str) -> None:
    text = yaml.safe_dump(spec("math-yaml"))
    response = clients["operator"].post("/api/v1/jobs/", text, content_type=content_type)
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.name == "math-yaml"
    assert job.spec_source == text


def test_submit_yaml_text_wrapped_in_json(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    text = yaml.safe_dump(spec("math-wrapped"))
    response = clients["operator"].post("/api/v1/jobs/", {"spec": text}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["name"] == "math-wrapped"


def test_submit_an_rlinf_config(clients: dict[str, APIClient], users: dict[str, User]) -> None:
    make_cluster({"r-a": ("H100", 8), "r-b": ("H100", 8)})
    text = (EXAMPLES / "rlinf-disaggregated.yaml").read_text()
    response = clients["operator"].post("/api/v1/jobs/", text, content_type="application/yaml")
    assert response.status_code == 201, response.content
    job = response.json()
    assert (job["spec_format"], job["policy"], job["total_gpus"]) == ("rlinf", "rlinf-auto", 16)
    assert {g["name"] for g in job["groups"]} == {"actor", "rollout", "inference", "reward"}


def test_bad_rlinf_config_names_the_key(clients: dict[str, APIClient], users: dict[str, User]) -> None:
    make_cluster({"r-a": ("H100", 8), "r-b": ("H100", 8)})
    text = (EXAMPLES / "rlinf-disaggregated.yaml").read_text()
    bad = text.replace("actor: 0-3", "actor: 0-3x").replace(
        "tensor_parallel_size: 2", "tensor_parallel_size: 0"
    )
    response = clients["operator"].post("/api/v1/jobs/", bad, content_type="text/yaml")
    assert response.status_code == 400
    assert sorted(field_paths(response)) == [
        "cluster.component_placement.actor",
        "rollout.tensor_parallel_size",
    ]
    assert not Job.objects.exists()


def test_bad_spec_names_every_key_path_and_writes_nothing(
    clients: dict[str, APIClient], cluster: list[Node]
) -> None:
    data = spec("bad")
    data["components"][1]["parallelism"] = {"tp": 0}
    data["policy"] = {"name": "no-such-policy"}
    data["workload"]["iterations"] = "many"
    response = clients["operator"].post("/api/v1/jobs/", data, format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "invalid_spec"
    assert {"components[1].parallelism.tp", "policy.name", "workload.iterations"} <= set(
        field_paths(response)
    )
    assert "components[1].parallelism.tp" in error["message"]
    assert not Job.objects.exists()
    assert not AuditEvent.objects.filter(verb="job.submit").exists()


def test_yaml_syntax_errors_point_at_the_line(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    response = clients["operator"].post(
        "/api/v1/jobs/", "name: x\ncomponents: [\n  - bad", content_type="application/yaml"
    )
    assert response.status_code == 400
    [problem] = error_of(response)["fields"]
    assert problem["path"] == ""
    assert "line" in problem["message"]


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ([1, 2, 3], ""),
        ({"spec": 42}, "spec"),
    ],
)
def test_bodies_that_are_not_a_spec(
    clients: dict[str, APIClient], cluster: list[Node], body: Any, path: str
) -> None:
    response = clients["operator"].post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 400
    assert field_paths(response) == [path]


def test_a_spec_that_can_never_fit_is_422(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    response = clients["operator"].post("/api/v1/jobs/", spec("huge", rollout=100), format="json")
    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "unschedulable"
    assert field_paths(response) == ["components.rollout"]
    assert not Job.objects.exists()


# --- idempotency -------------------------------------------------------------------------------


def test_same_key_same_spec_returns_the_same_job(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    operator = clients["operator"]
    first = operator.post("/api/v1/jobs/", spec("idem"), format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    again = operator.post("/api/v1/jobs/", spec("idem"), format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert Job.objects.count() == 1
    assert AuditEvent.objects.filter(verb="job.submit").count() == 1


def test_same_key_other_spec_is_409(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    operator = clients["operator"]
    operator.post("/api/v1/jobs/", spec("idem"), format="json", HTTP_IDEMPOTENCY_KEY="k-2")
    response = operator.post("/api/v1/jobs/", spec("other"), format="json", HTTP_IDEMPOTENCY_KEY="k-2")
    assert response.status_code == 409
    assert error_of(response)["code"] == "idempotency_conflict"
    assert field_paths(response) == ["Idempotency-Key"]
    assert list(Job.objects.values_list("name", flat=True)) == ["idem"]


def test_keys_are_per_owner(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    one = clients["operator"].post(
        "/api/v1/jobs/", spec("a", rollout=1, actor=1), format="json", HTTP_IDEMPOTENCY_KEY="k"
    )
    two = clients["admin"].post(
        "/api/v1/jobs/", spec("a", rollout=1, actor=1), format="json", HTTP_IDEMPOTENCY_KEY="k"
    )
    assert (one.status_code, two.status_code) == (201, 201)
    assert one.json()["id"] != two.json()["id"]


def test_an_overlong_key_is_400(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    response = clients["operator"].post(
        "/api/v1/jobs/", spec(), format="json", HTTP_IDEMPOTENCY_KEY="k" * 201
    )
    assert response.status_code == 400
    assert field_paths(response) == ["Idempotency-Key"]
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_concurrent_posts_with_one_key_make_one_job() -> None:
    make_cluster({"node-a": ("H100", 8)})
    operator = make_user("racer", "operator")
    _, raw = ApiToken.issue(operator, "cli")
    barrier = threading.Barrier(6)
    results: list[tuple[int, int]] = []
    lock = threading.Lock()

    def post() -> None:
        try:
            barrier.wait()
            response = bearer(raw).post(
                "/api/v1/jobs/", spec("race", rollout=2, actor=1), format="json", HTTP_IDEMPOTENCY_KEY="same"
            )
            with lock:
                results.append((response.status_code, response.json()["id"]))
        finally:
            connection.close()

    threads = [threading.Thread(target=post) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 6
    assert sorted(code for code, _ in results) == [200] * 5 + [201]
    assert len({job_id for _, job_id in results}) == 1
    assert Job.objects.count() == 1


# --- lists -------------------------------------------------------------------------------------


@pytest.fixture
def many_jobs(cluster: list[Node], users: dict[str, User]) -> list[Job]:
    """Seven jobs of two owners in several states and policies, submitted a day apart."""
    other = make_user("other-operator", "operator")
    jobs = []
    for index in range(7):
        owner = users["operator"] if index % 2 == 0 else other
        policy = "dynarl" if index < 4 else "static-disaggregated"
        job = submit(owner, spec(f"job-{index}", rollout=1, actor=1, policy=policy))
        Job.objects.filter(pk=job.pk).update(submitted_at=timezone.now() - timedelta(days=7 - index))
        jobs.append(job)
    for job in jobs[:2]:
        mark_running(job)
    return jobs


def ids(response: Any) -> list[int]:
    assert response.status_code == 200, response.content
    return [job["id"] for job in response.json()["results"]]


def test_list_is_paginated_with_a_count(clients: dict[str, APIClient], many_jobs: list[Job]) -> None:
    first = clients["viewer"].get("/api/v1/jobs/", {"page_size": 3})
    body = first.json()
    assert body["count"] == 7
    assert len(body["results"]) == 3
    assert body["previous"] is None and "page=2" in body["next"]
    last = clients["viewer"].get("/api/v1/jobs/", {"page_size": 3, "page": 3}).json()
    assert len(last["results"]) == 1 and last["next"] is None
    # Newest first by default.
    assert ids(first) == [many_jobs[6].pk, many_jobs[5].pk, many_jobs[4].pk]


def test_list_filters(clients: dict[str, APIClient], many_jobs: list[Job]) -> None:
    viewer = clients["viewer"]
    running = {j.pk for j in many_jobs[:2]}
    assert set(ids(viewer.get("/api/v1/jobs/", {"state": "running"}))) == running
    states = {
        j.pk for j in many_jobs if j.pk in running or Job.objects.get(pk=j.pk).state == JobState.ADMITTED
    }
    assert set(ids(viewer.get("/api/v1/jobs/", {"state": "running,admitted"}))) == states
    assert set(ids(viewer.get("/api/v1/jobs/?state=running&state=admitted"))) == states
    assert set(ids(viewer.get("/api/v1/jobs/", {"owner": "other-operator"}))) == {
        j.pk for j in many_jobs[1::2]
    }
    assert set(ids(viewer.get("/api/v1/jobs/", {"policy": "static-disaggregated"}))) == {
        j.pk for j in many_jobs[4:]
    }
    assert ids(viewer.get("/api/v1/jobs/", {"name": "JOB-3"})) == [many_jobs[3].pk]
    cutoff = (timezone.now() - timedelta(days=4, hours=12)).isoformat()
    assert set(ids(viewer.get("/api/v1/jobs/", {"submitted_after": cutoff}))) == {j.pk for j in many_jobs[3:]}
    assert set(ids(viewer.get("/api/v1/jobs/", {"submitted_before": cutoff}))) == {
        j.pk for j in many_jobs[:3]
    }
    assert ids(viewer.get("/api/v1/jobs/", {"ordering": "submitted_at"}))[0] == many_jobs[0].pk
    assert ids(viewer.get("/api/v1/jobs/", {"ordering": "name", "page_size": 2})) == [
        many_jobs[0].pk,
        many_jobs[1].pk,
    ]


def test_detail_shows_state_history_and_the_current_allocation(
    clients: dict[str, APIClient], running_job: Job
) -> None:
    job = clients["viewer"].get(f"/api/v1/jobs/{running_job.pk}/").json()
    assert (job["state"], job["state_reason"]) == ("running", "workers_launched")
    assert [t["to_state"] for t in job["transitions"]] == ["pending", "admitted", "running"]
    assert job["spec"]["name"] == "math-small"
    groups = {g["name"]: g for g in job["groups"]}
    assert groups["rollout"]["kind"] == "rollout"
    owned = {d["uid"] for g in job["groups"] for w in g["workers"] for d in w["devices"]}
    assert owned == set(Device.objects.filter(worker__group__job=running_job).values_list("uid", flat=True))
    assert len(owned) == job["allocated_gpus"] == 6
    worker = groups["actor"]["workers"][0]
    assert worker["state"] == "running"
    assert {"uid", "node", "hardware", "utilisation"} <= set(worker["devices"][0])
    for key in ("iteration", "iterations_total", "tokens_per_s", "total_gpus"):
        assert key in job


# --- steering ----------------------------------------------------------------------------------


def test_pause_resume_and_cancel(clients: dict[str, APIClient], running_job: Job) -> None:
    operator = clients["operator"]
    url = f"/api/v1/jobs/{running_job.pk}"
    paused = operator.post(
        f"{url}/pause/", {"detail": "investigating"}, format="json", HTTP_X_REQUEST_ID="p-1"
    )
    assert paused.status_code == 200
    assert (paused.json()["state"], paused.json()["state_detail"]) == ("paused_scheduling", "investigating")
    resumed = operator.post(f"{url}/resume/", {}, format="json")
    assert resumed.json()["state"] == "running"
    cancelled = clients["admin"].post(f"{url}/cancel/", {"detail": "done with it"}, format="json")
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "cancelled"
    assert [t["to_state"] for t in cancelled.json()["transitions"]][-3:] == [
        "paused_scheduling",
        "running",
        "cancelled",
    ]
    verbs = list(
        AuditEvent.objects.filter(job=running_job, actor_type="user")
        .order_by("id")
        .values_list("verb", "actor", "request_id")
    )
    assert verbs[-3:] == [
        ("job.paused_scheduling", "operator", "p-1"),
        ("job.running", "operator", verbs[-2][2]),
        ("job.cancelled", "admin", verbs[-1][2]),
    ]
    assert all(request_id for _, _, request_id in verbs[-3:])  # every API request has one
    # A terminal state cannot be left.
    again = operator.post(f"{url}/pause/", {}, format="json")
    assert again.status_code == 409


def test_action_detail_is_validated(clients: dict[str, APIClient], running_job: Job) -> None:
    response = clients["operator"].post(
        f"/api/v1/jobs/{running_job.pk}/pause/", {"detail": "x" * 3000}, format="json"
    )
    assert response.status_code == 400
    assert field_paths(response) == ["detail"]
    running_job.refresh_from_db()
    assert running_job.state == JobState.RUNNING


def test_manual_migration(clients: dict[str, APIClient], running_job: Job) -> None:
    response = clients["operator"].post(
        f"/api/v1/jobs/{running_job.pk}/migrate/",
        {"donor": "rollout", "recipient": "actor", "workers": 2, "reason": "trainer is the bottleneck"},
        format="json",
        HTTP_X_REQUEST_ID="mig-1",
    )
    assert response.status_code == 202, response.content
    migration = response.json()
    assert (migration["donor"], migration["recipient"], migration["requested_by"]) == (
        "rollout",
        "actor",
        "operator",
    )
    assert migration["state"] == "running"
    assert len(migration["device_uids"]) == 2
    assert migration["steps"] and migration["steps"][0]["kind"] == "pause_workers"
    event = AuditEvent.objects.get(verb="job.migrate", job=running_job)
    assert (event.actor, event.reason, event.request_id) == ("operator", "trainer is the bottleneck", "mig-1")

    play_agents()
    assert Migration.objects.get(pk=migration["id"]).state == MigrationState.COMMITTED
    job = clients["viewer"].get(f"/api/v1/jobs/{running_job.pk}/").json()
    assert {g["name"]: g["gpus"] for g in job["groups"]} == {"rollout": 2, "actor": 4}


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"donor": "nope", "recipient": "actor", "workers": 1}, "donor"),
        ({"donor": "rollout", "recipient": "rollout", "workers": 1}, "recipient"),
        ({"donor": "rollout", "recipient": "actor", "workers": 99}, "workers"),
        ({"donor": "rollout", "recipient": "actor", "workers": 0}, "workers"),
        ({"donor": "rollout", "recipient": "actor"}, "workers"),
    ],
)
def test_refused_manual_migrations_name_the_field(
    clients: dict[str, APIClient], running_job: Job, body: dict[str, Any], path: str
) -> None:
    response = clients["operator"].post(f"/api/v1/jobs/{running_job.pk}/migrate/", body, format="json")
    assert response.status_code == 400, response.content
    assert field_paths(response) == [path]
    assert not Migration.objects.exists()


def test_a_job_that_is_not_running_cannot_migrate(
    clients: dict[str, APIClient], cluster: list[Node], users: dict[str, User]
) -> None:
    job = submit(users["operator"], spec())
    response = clients["operator"].post(
        f"/api/v1/jobs/{job.pk}/migrate/",
        {"donor": "rollout", "recipient": "actor", "workers": 1},
        format="json",
    )
    assert response.status_code == 400
    assert field_paths(response) == ["job"]


def test_a_second_migration_in_flight_is_refused(clients: dict[str, APIClient], running_job: Job) -> None:
    body = {"donor": "rollout", "recipient": "actor", "workers": 1}
    url = f"/api/v1/jobs/{running_job.pk}/migrate/"
    assert clients["operator"].post(url, body, format="json").status_code == 202
    response = clients["operator"].post(url, body, format="json")
    assert response.status_code == 400
    assert "in flight" in error_of(response)["message"]
    assert Migration.objects.count() == 1


def test_submission_body_round_trips_through_json_text(
    clients: dict[str, APIClient], cluster: list[Node]
) -> None:
    text = json.dumps(spec("json-text"))
    response = clients["operator"].post("/api/v1/jobs/", {"spec": text}, format="json")
    assert response.status_code == 201
    assert Job.objects.get(pk=response.json()["id"]).spec_source == text
