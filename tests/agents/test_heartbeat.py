"""Heartbeats: latest values on devices and workers, the live window, downsampled history."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone
from pytest_django.fixtures import DjangoCaptureOnCommitCallbacks, Settings

from cluster.models import Device, Node
from common import redis as common_redis
from jobs.models import Job, Worker
from scheduler import telemetry
from scheduler.models import TelemetrySample
from tests.agents.conftest import Agent, register
from tests.factories import make_user, spec, submit

pytestmark = pytest.mark.django_db

Capture = DjangoCaptureOnCommitCallbacks


@pytest.fixture
def running(client: Client, bootstrap: str, settings: Settings) -> tuple[Agent, Job]:
    settings.TELEMETRY_BUCKET_S = 10.0
    agent, _ = register(client, bootstrap, "node-a", gpus=4)
    job = submit(make_user("alice"), spec(rollout=2, actor=2))
    return agent, job


def worker_names(job: Job, group: str) -> list[str]:
    return list(
        Worker.objects.filter(group__job=job, group__name=group)
        .order_by("name")
        .values_list("name", flat=True)
    )


def bucket_aligned_now(width: float = 10.0) -> float:
    """A time early in a bucket, so samples a few seconds apart share it."""
    return (time.time() // width) * width + 1.0


def test_heartbeat_updates_rows_window_and_history(
    running: tuple[Agent, Job], django_capture_on_commit_callbacks: Capture
) -> None:
    _agent, job = running
    rollout = worker_names(job, "rollout")
    start = bucket_aligned_now()
    skew = -1000.0  # the agent's clock is far behind; samples still land at server time
    bodies = []
    for second, (util, tokens) in enumerate([(0.9, 100), (0.5, 300)]):
        bodies.append(
            {
                "sent_at": start + second + skew,
                "devices": [
                    {"index": i, "utilisation": util, "memory_used_gb": 40.0 + i, "source": "nvml"}
                    for i in range(4)
                ],
                "workers": [
                    {
                        "worker": name,
                        "group": "rollout",
                        "at": start + second + skew,
                        "utilisation": util,
                        "queue_length": 3 + second,
                        "in_flight": 7,
                        "tokens": tokens,
                        "progress": 0.25 * (second + 1),
                        "waiting": 0.2 * (second + 1),
                    }
                    for name in rollout
                ],
            }
        )
    for second, body in enumerate(bodies):
        with django_capture_on_commit_callbacks(execute=True):
            outcome = telemetry.ingest_report(Node.objects.get(name="node-a"), body, now=start + second)
        assert outcome.accepted == 4 + 2 and not outcome.rejected

    devices = {d.index: d for d in Device.objects.all()}
    assert [devices[i].utilisation for i in range(4)] == [0.5] * 4
    assert [devices[i].memory_used_gb for i in range(4)] == [40.0, 41.0, 42.0, 43.0]
    assert {devices[i].reading_source for i in range(4)} == {"nvml"}
    assert devices[0].reported_at == datetime.fromtimestamp(start + 1, tz=UTC)
    assert set(Worker.objects.filter(name__in=rollout).values_list("utilisation", flat=True)) == {0.5}
    assert set(Worker.objects.filter(group__name="actor").values_list("utilisation", flat=True)) == {0.0}

    rows = list(TelemetrySample.objects.order_by("worker"))
    assert [r.worker for r in rows] == rollout
    for row in rows:
        assert row.job_id == job.pk and row.group == "rollout" and row.node.name == "node-a"
        assert row.bucket_start == datetime.fromtimestamp(start - 1.0, tz=UTC)
        assert row.samples == 2 and row.tokens == 400
        assert row.utilisation_mean == pytest.approx(0.7) and row.utilisation_min == 0.5
        assert (row.queue_length, row.in_flight) == (4, 7)
        assert row.waiting_mean == pytest.approx(0.3)

    window = telemetry.recent_samples(job.pk, start - 5)
    assert sorted((s.worker_id, s.at, s.utilisation, s.tokens) for s in window) == sorted(
        (name, start + second, util, tokens)
        for name in rollout
        for second, (util, tokens) in enumerate([(0.9, 100), (0.5, 300)])
    )
    assert {s.group_id for s in window} == {"rollout"} and {s.progress for s in window} == {0.25, 0.5}
    assert [s.at for s in telemetry.recent_samples(job.pk, start)] == [start + 1, start + 1]
    assert telemetry.recent_samples(job.pk + 1, 0) == []


def test_next_bucket_gets_its_own_row(running: tuple[Agent, Job]) -> None:
    _agent, job = running
    name = worker_names(job, "actor")[0]
    node = Node.objects.get(name="node-a")
    start = bucket_aligned_now()
    for at in (start, start + 10):
        telemetry.ingest_report(
            node, {"sent_at": at, "workers": [{"worker": name, "utilisation": 1.0, "tokens": 5}]}, now=at
        )
    assert TelemetrySample.objects.filter(worker=name).count() == 2


def test_repeated_heartbeat_changes_nothing(running: tuple[Agent, Job]) -> None:
    agent, job = running
    name = worker_names(job, "rollout")[0]
    body = {"sent_at": time.time(), "workers": [{"worker": name, "utilisation": 0.4, "tokens": 10}]}
    first = agent.heartbeat(body).json()
    again = agent.heartbeat(body).json()
    assert (first["accepted"], first["duplicate"]) == (1, False)
    assert (again["accepted"], again["duplicate"]) == (0, True)
    assert TelemetrySample.objects.get(worker=name).samples == 1
    # A clock reset far into the past is a new sequence, not a repeat.
    reset = agent.heartbeat({**body, "sent_at": body["sent_at"] - 3600}).json()
    assert reset["duplicate"] is False


def test_samples_of_workers_elsewhere_are_rejected(client: Client, bootstrap: str) -> None:
    register(client, bootstrap, "node-a", gpus=4)
    other, _ = register(client, bootstrap, "node-b", gpus=4)
    job = submit(make_user("alice"), spec(rollout=2, actor=2))
    on_a = list(
        Worker.objects.filter(group__job=job, devices__node__name="node-a").values_list("name", flat=True)
    )
    assert on_a
    body = {
        "sent_at": time.time(),
        "devices": [{"index": 9, "utilisation": 0.1}],
        "workers": [{"worker": on_a[0], "utilisation": 0.3}, {"worker": "nobody", "utilisation": 0.3}],
    }
    result = other.heartbeat(body).json()
    assert result["accepted"] == 0
    assert result["rejected"] == [
        {"device": 9, "reason": "no such device on this node"},
        {"worker": on_a[0], "reason": "not a live worker on this node"},
        {"worker": "nobody", "reason": "not a live worker on this node"},
    ]
    assert not TelemetrySample.objects.exists()
    assert Worker.objects.get(name=on_a[0]).utilisation == 0.0


def test_malformed_heartbeat_names_fields_and_writes_nothing(running: tuple[Agent, Job]) -> None:
    agent, job = running
    name = worker_names(job, "rollout")[0]
    now = time.time()
    body = {
        "sent_at": now,
        "devices": [
            {"index": 0, "utilisation": 0.5},
            {"index": 1, "utilisation": 1.5, "source": "guesswork"},
            {"index": 0, "utilisation": 0.1},
        ],
        "workers": [
            {"worker": name, "utilisation": 0.5, "tokens": -1, "turn": "napping", "waiting": 1.5},
            {"worker": "", "utilisation": "high", "at": now + 100, "progress": 2},
        ],
    }
    response = agent.heartbeat(body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert {f["path"] for f in error["fields"]} == {
        "devices[1].utilisation",
        "devices[1].source",
        "devices[2].index",
        "workers[0].tokens",
        "workers[0].turn",
        "workers[0].waiting",
        "workers[1].worker",
        "workers[1].utilisation",
        "workers[1].at",
        "workers[1].progress",
    }
    assert set(Device.objects.values_list("utilisation", flat=True)) == {0.0}
    assert not TelemetrySample.objects.exists()
    assert agent.heartbeat({"devices": []}).json()["error"]["fields"] == [
        {"path": "sent_at", "message": "must be a number"}
    ]
    assert agent.heartbeat([1, 2]).status_code == 400
    # Nothing was claimed either: the corrected heartbeat is not taken for a repeat.
    # (A time-sharing worker may say where it is in its turn-taking.)
    fixed = {"sent_at": now, "workers": [{"worker": name, "utilisation": 0.0, "turn": "offloaded"}]}
    assert agent.heartbeat(fixed).json()["accepted"] == 1


def test_heartbeat_marks_the_node_alive(running: tuple[Agent, Job]) -> None:
    agent, _ = running
    Node.objects.update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    before = timezone.now()
    assert agent.heartbeat({"sent_at": time.time()}).json()["node_status"] == "ready"
    last = Node.objects.get().last_heartbeat_at
    assert last is not None and last >= before


def test_window_is_trimmed_by_age_and_capped(
    running: tuple[Agent, Job], settings: Settings, django_capture_on_commit_callbacks: Capture
) -> None:
    _agent, job = running
    settings.TELEMETRY_LIVE_WINDOW_S = 30.0
    settings.TELEMETRY_LIVE_MAX_SAMPLES = 10
    names = worker_names(job, "rollout")
    node = Node.objects.get(name="node-a")
    start = float(int(time.time()) - 100)
    for second in range(8):
        at = start + second * 10  # 8 heartbeats over 70 s: all but the last 30 s fall out
        with django_capture_on_commit_callbacks(execute=True):
            telemetry.ingest_report(
                node, {"sent_at": at, "workers": [{"worker": n, "utilisation": 0.5} for n in names]}, now=at
            )
    kept = telemetry.recent_samples(job.pk, 0)
    assert {s.at for s in kept} == {start + 50, start + 60, start + 70}
    for second in range(8, 15):
        at = start + 70 + (second - 7) * 0.1  # many within the window: the cap keeps the newest 10
        with django_capture_on_commit_callbacks(execute=True):
            telemetry.ingest_report(
                node, {"sent_at": at, "workers": [{"worker": n, "utilisation": 0.5} for n in names]}, now=at
            )
    kept = telemetry.recent_samples(job.pk, 0)
    assert len(kept) == 10 and max(s.at for s in kept) == pytest.approx(start + 70.7)
    assert common_redis.shared_client().ttl(telemetry.window_key(job.pk)) > 0


def test_prune_deletes_only_expired_history(running: tuple[Agent, Job], settings: Settings) -> None:
    _, job = running
    settings.TELEMETRY_RETENTION_HOURS = 2
    now = timezone.now()
    for hours in (5, 3, 1, 0):
        TelemetrySample.objects.create(
            job=job, group="rollout", worker="w", bucket_start=now - timedelta(hours=hours), samples=1
        )
    assert telemetry.prune(now=now) == 2
    kept = sorted(
        round((now - b).total_seconds() / 3600)
        for b in TelemetrySample.objects.values_list("bucket_start", flat=True)
    )
    assert kept == [0, 1]
    assert telemetry.prune(now=now) == 0


def test_ingest_returns_samples_accepted(running: tuple[Agent, Job]) -> None:
    _, job = running
    node = Node.objects.get(name="node-a")
    names = worker_names(job, "rollout") + worker_names(job, "actor")
    body = {
        "sent_at": time.time(),
        "devices": [{"index": i, "utilisation": 0.2} for i in range(4)],
        "workers": [{"worker": n, "utilisation": 0.2} for n in names]
        + [{"worker": "ghost", "utilisation": 0.1}],
    }
    assert telemetry.ingest(node, body) == 8


@pytest.mark.django_db(transaction=True)
def test_rows_another_transaction_holds_are_skipped_not_waited_for(
    client: Client, bootstrap: str, settings: Settings
) -> None:
    """A job being released (or a migration committing) holds its worker and device rows; a
    heartbeat landing then applies the rest and keeps the history instead of waiting in a lock
    cycle with it."""
    settings.TELEMETRY_BUCKET_S = 10.0
    register(client, bootstrap, "node-a", gpus=4)
    job = submit(make_user("alice"), spec(rollout=2, actor=2))
    held_worker, free_worker = worker_names(job, "rollout")
    node = Node.objects.get(name="node-a")
    now = bucket_aligned_now()
    body = {
        "sent_at": now,
        "devices": [{"index": i, "utilisation": 0.7, "memory_used_gb": 1.0} for i in range(4)],
        "workers": [
            {"worker": name, "group": "rollout", "at": now, "utilisation": 0.7, "tokens": 100}
            for name in (held_worker, free_worker)
        ],
    }
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"] or "127.0.0.1", port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"]
    ) as other:
        other.execute("SELECT 1 FROM jobs_worker WHERE name = %s FOR UPDATE", [held_worker])
        other.execute("SELECT 1 FROM agents_device WHERE node_id = %s AND index = 0 FOR UPDATE", [node.pk])
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '5s'")  # a wait fails the test, not hangs it
            outcome = telemetry.ingest_report(node, body, now=now)
        other.rollback()

    assert outcome.accepted == 4 + 2 and not outcome.rejected
    workers = {w.name: w.utilisation for w in Worker.objects.filter(name__in=[held_worker, free_worker])}
    assert workers[free_worker] == 0.7 and workers[held_worker] != 0.7
    devices = {d.index: d.utilisation for d in Device.objects.filter(node=node)}
    assert devices[0] != 0.7 and [devices[i] for i in (1, 2, 3)] == [0.7] * 3
    history = set(TelemetrySample.objects.values_list("worker", flat=True))
    assert {held_worker, free_worker} <= history
