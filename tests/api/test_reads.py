"""The read APIs: nodes, devices, worker groups, snapshots, decisions, migrations, predictor
samples and their summary, ticks, alerts, audit events and the cluster summary."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from cluster.models import Device, DeviceStatus, Node, NodeStatus
from common.models import AuditEvent
from jobs.models import Job
from scheduler.models import HypergraphSnapshot, Migration, MigrationState, PredictorSample, PredictorScope
from tests.api.conftest import error_of, field_paths
from tests.factories import spec, submit

pytestmark = pytest.mark.django_db


def results(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.content
    found: list[dict[str, Any]] = response.json()["results"]
    return found


# --- nodes and devices -------------------------------------------------------------------------


def test_nodes_show_status_heartbeat_and_devices(clients: dict[str, APIClient], running_job: Job) -> None:
    Node.objects.filter(name="node-c").update(status=NodeStatus.DRAINED)
    Device.objects.filter(uid="node-a/gpu0").update(utilisation=0.5)
    Device.objects.filter(uid="node-a/gpu1").update(utilisation=0.3)
    nodes = {n["name"]: n for n in results(clients["viewer"].get("/api/v1/nodes/"))}
    assert set(nodes) == {"node-a", "node-b", "node-c"}
    a = nodes["node-a"]
    assert (a["status"], a["hardware"], a["devices_total"]) == ("ready", ["H100"], 4)
    assert a["devices_free"] + a["devices_allocated"] == 4
    assert a["last_heartbeat_at"] is not None
    assert a["utilisation_mean"] == pytest.approx(0.2)
    assert nodes["node-c"]["status"] == "drained"
    assert [n["name"] for n in results(clients["viewer"].get("/api/v1/nodes/", {"hardware": "A100"}))] == [
        "node-c"
    ]
    assert {n["name"] for n in results(clients["viewer"].get("/api/v1/nodes/", {"status": "ready"}))} == {
        "node-a",
        "node-b",
    }


def test_devices_show_their_owner(clients: dict[str, APIClient], running_job: Job) -> None:
    devices = results(clients["viewer"].get("/api/v1/devices/", {"job": running_job.pk, "page_size": 100}))
    assert len(devices) == 6
    for device in devices:
        assert device["status"] == "allocated"
        assert (device["job"], device["job_name"]) == (running_job.pk, "math-small")
        assert device["group"] in {"rollout", "actor"}
        assert device["worker_name"]
        assert device["last_heartbeat_at"] is not None
    free = results(clients["viewer"].get("/api/v1/devices/", {"status": "free", "page_size": 100}))
    assert len(free) == 4
    assert all(d["job"] is None and d["worker_name"] is None for d in free)
    a100 = results(clients["viewer"].get("/api/v1/devices/", {"hardware": "A100"}))
    assert [d["uid"] for d in a100] == ["node-c/gpu0", "node-c/gpu1"]
    on_b = results(clients["viewer"].get("/api/v1/devices/", {"node": "node-b", "group": "rollout"}))
    assert all(d["node"] == "node-b" and d["group"] == "rollout" for d in on_b)
    idle = results(clients["viewer"].get("/api/v1/devices/", {"idle": "true", "page_size": 100}))
    assert {d["status"] for d in idle} == {DeviceStatus.FREE}


def test_worker_groups_per_job(
    clients: dict[str, APIClient], running_job: Job, users: dict[str, User]
) -> None:
    submit(users["admin"], spec("second", rollout=1, actor=1))
    groups = results(clients["viewer"].get("/api/v1/worker-groups/", {"job": running_job.pk}))
    assert [(g["name"], g["gpus"], len(g["workers"])) for g in groups] == [("rollout", 4, 4), ("actor", 2, 2)]
    detail = clients["viewer"].get(f"/api/v1/worker-groups/{groups[1]['id']}/").json()
    assert detail["depends_on"] == ["rollout"]
    assert detail["signals"] is None


# --- snapshots ---------------------------------------------------------------------------------


def test_snapshots_list_latest_and_at_a_time(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    job, (first, second) = history["job"], history["snapshots"]
    earlier = timezone.now() - timedelta(minutes=10)
    HypergraphSnapshot.objects.filter(pk=first.pk).update(taken_at=earlier)
    viewer = clients["viewer"]

    listed = results(viewer.get("/api/v1/snapshots/", {"job": job.pk}))
    # The migration's commit took one too; newest first, the back-dated one last.
    assert len(listed) == HypergraphSnapshot.objects.filter(job=job).count() >= 2
    assert listed[0]["id"] == second.pk and listed[-1]["id"] == first.pk
    assert "data" not in listed[0]
    assert (
        results(viewer.get("/api/v1/snapshots/", {"job": job.pk, "cause": "admission"}))[0]["id"] == first.pk
    )

    latest = viewer.get("/api/v1/snapshots/latest/", {"job": job.pk}).json()
    assert latest["id"] == second.pk
    assert {n["id"] for n in latest["data"]["nodes"]} == {"rollout", "actor"}

    at = (earlier + timedelta(minutes=1)).isoformat()
    assert viewer.get("/api/v1/snapshots/latest/", {"job": job.pk, "at": at}).json()["id"] == first.pk
    assert (
        viewer.get("/api/v1/snapshots/latest/", {"job": job.pk, "at": earlier.isoformat()}).json()["id"]
        == first.pk
    )

    before_any = (earlier - timedelta(minutes=1)).isoformat()
    missing = viewer.get("/api/v1/snapshots/latest/", {"job": job.pk, "at": before_any})
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "not_found"

    bad = viewer.get("/api/v1/snapshots/latest/", {"at": "noon"})
    assert bad.status_code == 400
    assert sorted(field_paths(bad)) == ["at", "job"]

    detail = viewer.get(f"/api/v1/snapshots/{first.pk}/").json()
    assert detail["cause"] == "admission" and "data" in detail


# --- decisions and migrations ------------------------------------------------------------------


def test_decisions_by_job_reason_and_time(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    job, decision = history["job"], history["decision"]
    viewer = clients["viewer"]
    found = results(viewer.get("/api/v1/decisions/", {"job": job.pk, "reason": "operator_request"}))
    assert [d["id"] for d in found] == [decision.pk]
    assert found[0]["migration"] == history["migration"].migration_id
    assert found[0]["requested_by"] == "operator"
    assert results(viewer.get("/api/v1/decisions/", {"reason": "donor_low_utilisation"})) == []
    future = (timezone.now() + timedelta(hours=1)).isoformat()
    assert results(viewer.get("/api/v1/decisions/", {"after": future})) == []
    assert len(results(viewer.get("/api/v1/decisions/", {"before": future}))) == 1


def test_migrations_with_steps_and_filters(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    job, migration = history["job"], history["migration"]
    viewer = clients["viewer"]
    [listed] = results(viewer.get("/api/v1/migrations/", {"job": job.pk}))
    assert listed["migration_id"] == migration.migration_id
    assert listed["state"] == "committed"
    kinds = [s["kind"] for s in listed["steps"]]
    assert kinds[0] == "pause_workers" and len(kinds) == migration.steps.count()
    assert all(s["state"] == "done" for s in listed["steps"])
    assert "plan" not in listed

    detail = viewer.get(f"/api/v1/migrations/{migration.pk}/").json()
    assert detail["plan"]["migration_id"] == migration.migration_id

    strategy = migration.strategy  # e.g. workload+p2p
    side = strategy.split("+")[0]

    def count(**query: Any) -> int:
        return len(results(viewer.get("/api/v1/migrations/", query)))

    assert count(state="committed") == 1
    assert count(state="running,planned") == 0
    assert count(strategy=side) == 1
    assert count(strategy=strategy) == 1
    assert count(strategy=side[:-1]) == 0  # a part of a name is not a strategy
    assert count(donor="rollout", recipient="actor") == 1
    assert count(donor="actor") == 0
    assert count(after=(timezone.now() + timedelta(minutes=1)).isoformat()) == 0
    bad = viewer.get("/api/v1/migrations/", {"state": "exploded"})
    assert bad.status_code == 400 and field_paths(bad) == ["state"]


# --- predictor samples -------------------------------------------------------------------------


def test_predictor_samples_and_their_summary(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    job, migration = history["job"], history["migration"]
    viewer = clients["viewer"]
    samples = results(viewer.get("/api/v1/predictor-samples/", {"job": job.pk}))
    assert len(samples) == 3
    by_scope = {s["scope"]: s for s in samples}
    assert by_scope["donor"]["abs_pct_error"] == pytest.approx(10.0)
    assert by_scope["job"]["abs_pct_error"] is None  # observed 0: no percentage
    assert by_scope["donor"]["migration"] == migration.migration_id
    assert len(results(viewer.get("/api/v1/predictor-samples/", {"component": "actor"}))) == 1
    assert len(results(viewer.get("/api/v1/predictor-samples/", {"scope": "donor,recipient"}))) == 2

    # A second rollout sample: MAPE is the mean of 10% and 30%, the max 30%.
    second = Migration.objects.create(
        migration_id="m-extra", job=job, strategy="workload", plan={}, state=MigrationState.COMMITTED
    )
    PredictorSample.objects.create(
        migration=second, job=job, scope=PredictorScope.DONOR, group="rollout", component="rollout",
        predicted=70.0, observed=100.0,
    )  # fmt: skip
    summary = viewer.get("/api/v1/predictor-samples/summary/", {"job": job.pk})
    assert summary.status_code == 200
    rows = {(r["component"], r["scope"]): r for r in summary.json()}
    rollout = rows[("rollout", "donor")]
    assert rollout["count"] == 2
    assert rollout["mape"] == pytest.approx(20.0)
    assert rollout["max_abs_pct_error"] == pytest.approx(30.0)
    assert rollout["max_abs_error"] == pytest.approx(30.0)
    assert rows[("actor", "recipient")]["mape"] == pytest.approx(30.0)
    job_row = rows[("", "job")]
    assert (job_row["count"], job_row["mape"], job_row["max_abs_error"]) == (1, None, pytest.approx(50.0))
    only_actor = viewer.get("/api/v1/predictor-samples/summary/", {"component": "actor"}).json()
    assert [(r["component"], r["count"]) for r in only_actor] == [("actor", 1)]


# --- ticks, alerts -----------------------------------------------------------------------------


def test_ticks_per_job(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    [tick] = results(clients["viewer"].get("/api/v1/ticks/", {"job": history["job"].pk}))
    assert (tick["outcome"], tick["duration_ms"]) == ("no_change", 12.5)
    assert tick["note"] == "no group is idle enough to lend its GPUs"  # why nothing moved
    assert results(clients["viewer"].get("/api/v1/ticks/", {"outcome": "decided"})) == []


def test_alerts_open_and_cleared(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    viewer = clients["viewer"]
    open_alerts = results(viewer.get("/api/v1/alerts/", {"open": "true"}))
    assert [(a["kind"], a["open"]) for a in open_alerts] == [("worker_stuck", True)]
    cleared = results(viewer.get("/api/v1/alerts/", {"open": "false"}))
    assert [(a["kind"], a["node"], a["open"]) for a in cleared] == [("heartbeat_gap", "node-c", False)]
    assert len(results(viewer.get("/api/v1/alerts/", {"job": history["job"].pk}))) == 1
    assert len(results(viewer.get("/api/v1/alerts/", {"node": "node-c"}))) == 1


# --- audit -------------------------------------------------------------------------------------


def test_audit_events_and_their_filters(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    job = history["job"]
    operator, viewer = clients["operator"], clients["viewer"]
    operator.post(f"/api/v1/jobs/{job.pk}/pause/", {}, format="json", HTTP_X_REQUEST_ID="audit-req-1")

    def found(**query: Any) -> list[dict[str, Any]]:
        return results(viewer.get("/api/v1/audit-events/", {"page_size": 500, **query}))

    [paused] = found(request_id="audit-req-1")
    assert (paused["verb"], paused["actor"], paused["actor_type"], paused["actor_user"]) == (
        "job.paused_scheduling",
        "operator",
        "user",
        "operator",
    )
    assert paused["job"] == job.pk and paused["object_type"] == "jobs.job"
    assert {e["actor_type"] for e in found(actor_type="agent")} == {"agent"}
    assert found(actor_type="agent")
    assert {e["verb"] for e in found(verb="job.submit,job.paused_scheduling")} == {
        "job.submit",
        "job.paused_scheduling",
    }
    assert all(e["actor"] == "operator" for e in found(actor="operator"))
    migration = history["migration"]
    assert {e["verb"] for e in found(object_type="scheduler.migration", object_id=str(migration.pk))} >= {
        "migration.plan"
    }
    assert len(found(job=job.pk)) == AuditEvent.objects.filter(job=job).count()
    future = (timezone.now() + timedelta(minutes=1)).isoformat()
    assert found(after=future) == []
    oldest = AuditEvent.objects.order_by("at", "id").first()
    assert oldest is not None
    assert found(ordering="at")[0]["id"] == oldest.pk


# --- cluster -----------------------------------------------------------------------------------


def test_cluster_summary(
    clients: dict[str, APIClient], history: dict[str, Any], users: dict[str, User]
) -> None:
    submit(users["operator"], spec("queued", rollout=8, actor=2))  # does not fit now: pending
    lost = Device.objects.filter(status=DeviceStatus.FREE).order_by("uid").first()
    assert lost is not None
    Device.objects.filter(pk=lost.pk).update(status=DeviceStatus.LOST)
    summary = clients["viewer"].get("/api/v1/cluster/").json()
    gpus = summary["gpus"]
    assert gpus["total"] == 10
    assert gpus["by_status"] == {"free": 3, "allocated": 6, "lost": 1}
    expected: dict[str, list[int]] = {"A100": [2, 0, 0], "H100": [8, 0, 0]}
    for device in Device.objects.all():
        if device.status == DeviceStatus.FREE:
            expected[device.hardware][1] += 1
        elif device.status == DeviceStatus.LOST:
            expected[device.hardware][2] += 1
    assert {h["hardware"]: [h["total"], h["free"], h["lost"]] for h in gpus["by_hardware"]} == expected
    assert sum(h["allocated"] for h in gpus["by_hardware"]) == 6
    [job] = gpus["by_job"]
    assert (job["job"], job["gpus"]) == (history["job"].pk, 6)
    # After the committed migration: two rollout workers went to the actor.
    assert {c["group"]: c["gpus"] for c in job["components"]} == {"rollout": 2, "actor": 4}
    assert summary["nodes"] == {"total": 3, "by_status": {"ready": 3, "lost": 0, "drained": 0}}
    assert summary["jobs"]["by_state"]["running"] == 1
    assert summary["jobs"]["queue_length"] == 1
    assert summary["migrations_in_flight"] == 0
    assert summary["open_alerts"] == 1
