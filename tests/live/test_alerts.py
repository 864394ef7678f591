"""Anomaly alerts: each kind raised from rows, kept while it holds, cleared when it recovers."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import psycopg
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.db import connection
from django.utils import timezone

from cluster.models import NodeStatus
from common.events import CLUSTER_GROUP, job_group
from common.models import AuditEvent
from jobs.models import Job, JobState, Worker, WorkerState
from scheduler import alerts
from scheduler.models import Alert
from tests.live.conftest import allocate, make_group, make_job, make_node, make_user, make_worker, mid_bucket
from tests.services import wait_until

Telemetry = Callable[..., None]


def thresholds(**overrides: float) -> alerts.Thresholds:
    values = {
        "stuck_window_s": 60.0,
        "stuck_utilisation": 0.02,
        "group_busy_utilisation": 0.5,
        "collapse_window_s": 60.0,
        "collapse_history_s": 600.0,
        "collapse_fraction": 0.2,
        "recovered_fraction": 0.5,
        "heartbeat_gap_s": 10.0,
        "bucket_s": 10.0,
    }
    values.update(overrides)
    return alerts.Thresholds(**values)


def detect(now: datetime | None = None) -> alerts.DetectionResult:
    return alerts.run_detection(now=now, thresholds=thresholds())


def open_alerts() -> list[tuple[str, str]]:
    return sorted(Alert.objects.filter(cleared_at__isnull=True).values_list("kind", "subject"))


@pytest.fixture
def rollout_job() -> tuple[Job, list[Worker]]:
    job = make_job(make_user("op", "operator"), "math", state=JobState.RUNNING)
    group = make_group(job, "rollout", "rollout")
    return job, [make_worker(group, f"math-rollout-w{i}") for i in range(3)]


# --- worker stuck -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_worker_idle_while_its_group_works_is_raised_then_cleared(
    rollout_job: tuple[Job, list[Worker]], telemetry: Telemetry
) -> None:
    job, (stuck, busy_a, busy_b) = rollout_job
    node = make_node("node-a", gpus=1)
    allocate(node.devices.get(), stuck)
    telemetry(stuck, utilisation=0.0)
    telemetry(busy_a, utilisation=0.9)
    telemetry(busy_b, utilisation=0.7)

    result = detect()
    assert [(a.kind, a.subject) for a in result.raised] == [("worker_stuck", "worker:math-rollout-w0")]
    alert = result.raised[0]
    assert alert.job_id == job.pk
    assert alert.node_id == node.pk
    assert "80%" in alert.message  # the rest of the group's average
    audit = AuditEvent.objects.get(verb="alert.raise")
    assert (audit.actor, audit.actor_type, audit.job_id) == ("monitor", "system", job.pk)

    # Still idle: the same alert stays open, nothing new is raised.
    again = detect()
    assert again.raised == [] and again.cleared == []
    assert Alert.objects.count() == 1

    # It works again: the latest bucket shows utilisation, the alert clears.
    telemetry(stuck, utilisation=0.6, span_s=10)
    Worker.objects.filter(pk=stuck.pk).update(utilisation=0.6)
    cleared = detect()
    assert [a.pk for a in cleared.cleared] == [alert.pk]
    alert.refresh_from_db()
    assert alert.cleared_at is not None
    assert AuditEvent.objects.filter(verb="alert.clear", object_id=str(alert.pk)).exists()
    assert open_alerts() == []


@pytest.mark.django_db
def test_no_stuck_alert_when_the_group_idles_too_or_the_worker_just_started(
    rollout_job: tuple[Job, list[Worker]], telemetry: Telemetry
) -> None:
    _, (a, b, c) = rollout_job
    for worker in (a, b, c):
        telemetry(worker, utilisation=0.0)  # the whole group drained: normal at the end of a phase
    assert detect().raised == []

    telemetry(b, utilisation=0.9)
    telemetry(c, utilisation=0.9)
    Alert.objects.all().delete()
    fresh = make_worker(a.group, "math-rollout-w3", started_ago_s=20)
    telemetry(fresh, utilisation=0.0, span_s=20)  # only 20 s of history: not idle "for a window"
    raised = {alert.subject for alert in detect().raised}
    assert raised == {"worker:math-rollout-w0"}


@pytest.mark.django_db
def test_stuck_alert_clears_when_the_worker_stops(
    rollout_job: tuple[Job, list[Worker]], telemetry: Telemetry
) -> None:
    _, (stuck, busy_a, busy_b) = rollout_job
    telemetry(stuck, utilisation=0.0)
    telemetry(busy_a, utilisation=0.9)
    telemetry(busy_b, utilisation=0.9)
    assert len(detect().raised) == 1
    Worker.objects.filter(pk=stuck.pk).update(state=WorkerState.STOPPED)
    assert len(detect().cleared) == 1


# --- throughput collapse ----------------------------------------------------------------------


@pytest.fixture
def trainer() -> tuple[Job, Worker]:
    job = make_job(make_user("op", "operator"), "grpo", state=JobState.RUNNING)
    make_group(job, "rollout", "rollout")
    return job, make_worker(make_group(job, "actor", "actor"), "grpo-actor-w0")


@pytest.mark.django_db
def test_throughput_collapse_is_raised_held_with_hysteresis_and_cleared(
    trainer: tuple[Job, Worker], telemetry: Telemetry
) -> None:
    job, actor = trainer
    now = mid_bucket()

    def recent(tokens_per_bucket: int) -> None:
        telemetry(actor, utilisation=0.9, tokens=tokens_per_bucket, span_s=60, now=now)

    # Nine minutes at 1,000 tokens/s (10,000 per 10 s bucket), then a minute at 50 tokens/s.
    telemetry(actor, utilisation=0.9, tokens=10_000, span_s=540, until_ago_s=60, now=now)
    recent(500)
    raised = detect(now).raised
    assert [(a.kind, a.subject) for a in raised] == [("throughput_collapse", f"job:{job.pk}")]
    assert "5% of its recent median of 1000 tokens/s" in raised[0].message

    recent(3_000)  # 30%: above the raise threshold but under the recovery one, so it stays open
    result = detect(now)
    assert result.raised == [] and result.cleared == []
    assert open_alerts() == [("throughput_collapse", f"job:{job.pk}")]

    recent(8_000)  # 80%: recovered
    assert [a.subject for a in detect(now).cleared] == [f"job:{job.pk}"]
    assert open_alerts() == []


@pytest.mark.django_db
def test_a_long_collapse_is_not_forgiven_as_the_new_normal(
    trainer: tuple[Job, Worker], telemetry: Telemetry
) -> None:
    _, actor = trainer
    start = mid_bucket() - timedelta(minutes=20)
    telemetry(actor, utilisation=0.9, tokens=10_000, span_s=540, until_ago_s=60, now=start)
    telemetry(actor, utilisation=0.1, tokens=100, span_s=60, now=start)
    assert len(detect(start).raised) == 1
    # Twenty minutes later, still collapsed: a median over the last ten minutes alone would now be
    # the collapsed rate, but the baseline stays the one from before the collapse.
    later = start + timedelta(minutes=20)
    telemetry(actor, utilisation=0.1, tokens=100, span_s=20 * 60, now=later)
    result = detect(later)
    assert result.cleared == []
    assert len(open_alerts()) == 1


@pytest.mark.django_db
def test_no_collapse_alert_without_enough_history(trainer: tuple[Job, Worker], telemetry: Telemetry) -> None:
    _, actor = trainer
    now = mid_bucket()
    telemetry(actor, utilisation=0.9, tokens=10_000, span_s=120, until_ago_s=60, now=now)  # two windows only
    telemetry(actor, utilisation=0.9, tokens=0, span_s=60, now=now)
    assert detect(now).raised == []


@pytest.mark.django_db
def test_rollout_tokens_count_when_the_job_has_no_trainer(telemetry: Telemetry) -> None:
    job = make_job(make_user("op", "operator"), "gen-only", state=JobState.RUNNING)
    engine = make_worker(make_group(job, "rollout", "rollout"), "gen-rollout-w0")
    now = mid_bucket()
    telemetry(engine, utilisation=0.9, tokens=10_000, span_s=540, until_ago_s=60, now=now)
    telemetry(engine, utilisation=0.9, tokens=0, span_s=60, now=now)
    assert [a.subject for a in detect(now).raised] == [f"job:{job.pk}"]


@pytest.mark.django_db
def test_alerts_of_a_finished_job_are_cleared(trainer: tuple[Job, Worker], telemetry: Telemetry) -> None:
    job, actor = trainer
    now = mid_bucket()
    telemetry(actor, utilisation=0.9, tokens=10_000, span_s=540, until_ago_s=60, now=now)
    telemetry(actor, utilisation=0.9, tokens=0, span_s=60, now=now)
    assert len(detect(now).raised) == 1
    Job.objects.filter(pk=job.pk).update(state=JobState.CANCELLED)
    assert len(detect(now).cleared) == 1


# --- heartbeat gaps ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_heartbeat_gap_is_raised_before_the_node_is_lost_and_cleared_when_it_beats() -> None:
    quiet = make_node("node-quiet", heartbeat_ago_s=20)
    make_node("node-fine", heartbeat_ago_s=1)
    never = make_node("node-never", heartbeat_ago_s=None)  # registered an hour ago, never beat
    gone = make_node("node-gone", heartbeat_ago_s=600)
    gone.status = NodeStatus.LOST  # lost before any gap alert: being lost is its own record
    gone.save()

    result = detect()
    assert sorted(a.subject for a in result.raised) == ["node:node-never", "node:node-quiet"]
    alert = Alert.objects.get(subject="node:node-quiet")
    assert alert.node_id == quiet.pk and alert.job_id is None
    assert "no heartbeat for 20 s" in alert.message

    # The quiet node is declared lost: its alert stays open, the gap has not closed.
    quiet.status = NodeStatus.LOST
    quiet.save()
    assert detect().cleared == []

    quiet.last_heartbeat_at = timezone.now()
    quiet.save()
    never.last_heartbeat_at = timezone.now()
    never.save()
    assert sorted(a.subject for a in detect().cleared) == ["node:node-never", "node:node-quiet"]
    assert open_alerts() == []


@pytest.mark.django_db
def test_an_overlapping_run_does_nothing() -> None:
    make_node("node-quiet", heartbeat_ago_s=60)
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        user=db["USER"],
        dbname=db["NAME"],
        autocommit=True,
    ) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [alerts._ADVISORY_LOCK_KEY])
        result = detect()
        other.execute("SELECT pg_advisory_unlock(%s)", [alerts._ADVISORY_LOCK_KEY])
    assert result.skipped
    assert result.raised == []
    assert detect().raised  # once the other run is done, this one acts


# --- live events and the beat task ------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_raising_and_clearing_publish_alert_events_to_the_job_and_the_cluster(
    rollout_job: tuple[Job, list[Worker]], telemetry: Telemetry
) -> None:
    job, (stuck, busy_a, busy_b) = rollout_job
    telemetry(stuck, utilisation=0.0)
    telemetry(busy_a, utilisation=0.9)
    telemetry(busy_b, utilisation=0.9)

    def recover() -> None:
        telemetry(stuck, utilisation=0.8, span_s=10)
        Worker.objects.filter(pk=stuck.pk).update(utilisation=0.8)

    async def scenario() -> None:
        # One event loop throughout: the Redis layer's receive buffers belong to a loop.
        layer = get_channel_layer()
        job_channel, cluster_channel = await layer.new_channel(), await layer.new_channel()
        await layer.group_add(job_group(job.pk), job_channel)
        await layer.group_add(CLUSTER_GROUP, cluster_channel)

        raised = (await database_sync_to_async(detect)()).raised[0]
        for channel in (job_channel, cluster_channel):
            message = await layer.receive(channel)
            assert (message["type"], message["event"]) == ("dynarl.event", "alert")
            assert (message["data"]["id"], message["data"]["state"]) == (raised.pk, "raised")
            assert message["data"]["kind"] == "worker_stuck"

        await database_sync_to_async(recover)()
        await database_sync_to_async(detect)()
        for channel in (job_channel, cluster_channel):
            message = await layer.receive(channel)
            assert (message["data"]["id"], message["data"]["state"]) == (raised.pk, "cleared")
            assert message["data"]["cleared_at"] is not None

    async_to_sync(scenario)()


@pytest.mark.django_db(transaction=True)
def test_the_beat_task_runs_detection_in_a_real_worker(celery_worker: None) -> None:
    from scheduler.tasks_alerts import detect_anomalies

    make_node("node-quiet", heartbeat_ago_s=20)
    detect_anomalies.delay()
    assert wait_until(lambda: Alert.objects.filter(subject="node:node-quiet").exists(), timeout_s=30)
    assert AuditEvent.objects.filter(verb="alert.raise", actor="monitor").count() == 1
