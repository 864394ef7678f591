"""Telemetry roll-ups and job-state events reach WebSocket clients through the real Redis layer."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from common import events
from common.models import ApiToken
from controlplane.asgi import application
from jobs.models import JobState
from scheduler.models import GroupSignalsRecord
from scheduler.services import rollups
from tests.live.conftest import allocate, make_group, make_job, make_node, make_user, make_worker

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_S = 10


def signals(group: str, utilisation: float, tokens_per_s: float) -> dict[str, Any]:
    return {
        "group_id": group,
        "at": 0.0,
        "window_s": 10.0,
        "workers": 2,
        "utilisation_mean": utilisation,
        "utilisation_p50": utilisation,
        "utilisation_p90": utilisation,
        "utilisation_p99": utilisation,
        "low_utilisation_fraction": 0.5,
        "low_utilisation_workers": ["w1"],
        "queue_length": 4,
        "in_flight": 9,
        "max_in_flight_per_worker": 0,
        "tokens_per_s": tokens_per_s,
        "progress": 0.25,
        "busy": True,
    }


def test_rollups_go_to_each_running_job_and_to_the_overview() -> None:
    operator = make_user("op", "operator")
    job = make_job(operator, "live", state=JobState.RUNNING, tokens_per_s=900.0, iteration=2)
    idle = make_job(operator, "stale", state=JobState.RUNNING)
    rollout, actor = make_group(job, "rollout", "rollout"), make_group(job, "actor", "actor")
    GroupSignalsRecord.objects.create(group=rollout, data=signals("rollout", 0.3, 5000.0))
    GroupSignalsRecord.objects.create(group=actor, data=signals("actor", 0.9, 900.0))
    stale = make_group(idle, "rollout", "rollout")  # signals from long ago: nothing new to say
    GroupSignalsRecord.objects.create(
        group=stale, data=signals("rollout", 0.1, 1.0), computed_at=timezone.now() - timedelta(minutes=5)
    )
    node = make_node("node-a", gpus=2)
    device = node.devices.get(index=0)
    allocate(device, make_worker(actor, "live-actor-w0"))
    node.devices.filter(pk=device.pk).update(utilisation=0.75, reported_at=timezone.now())
    _, raw = ApiToken.issue(operator, "cli")

    async def scenario() -> None:
        watch_job = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/?token={raw}")
        watch_idle = WebsocketCommunicator(application, f"/ws/jobs/{idle.pk}/?token={raw}")
        overview = WebsocketCommunicator(application, f"/ws/cluster/?token={raw}")
        for comm in (watch_job, watch_idle, overview):
            assert (await comm.connect(timeout=WAIT_S))[0]
            assert (await comm.receive_json_from(timeout=WAIT_S))["type"] == "hello"

        assert await database_sync_to_async(rollups.publish_telemetry_rollups)() == 1

        frame = await watch_job.receive_json_from(timeout=WAIT_S)
        assert frame["type"] == "telemetry"
        data = frame["data"]
        assert (data["scope"], data["job"], data["tokens_per_s"], data["iteration"]) == (
            "job",
            job.pk,
            900.0,
            2,
        )
        assert data["groups"]["rollout"]["kind"] == "rollout"
        assert data["groups"]["rollout"]["utilisation_mean"] == 0.3
        assert data["groups"]["actor"]["tokens_per_s"] == 900.0
        assert "low_utilisation_workers" not in data["groups"]["rollout"]

        frame = await overview.receive_json_from(timeout=WAIT_S)
        assert frame["type"] == "telemetry"
        cluster = frame["data"]
        assert cluster["scope"] == "cluster"
        assert cluster["gpus"] == {"free": 1, "allocated": 1, "lost": 0}
        assert cluster["allocated_utilisation_mean"] == 0.75
        assert (cluster["running_jobs"], cluster["tokens_per_s"]) == (2, 900.0)

        assert await watch_idle.receive_nothing(timeout=1)
        for comm in (watch_job, watch_idle, overview):
            await comm.disconnect()

    async_to_sync(scenario)()


def test_job_state_events_reach_the_job_page_and_the_overview() -> None:
    operator = make_user("op", "operator")
    job = make_job(operator, "j", state=JobState.CANCELLED, state_reason="cancelled_by_operator")
    _, raw = ApiToken.issue(operator, "cli")

    async def scenario() -> None:
        watch = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/?token={raw}")
        overview = WebsocketCommunicator(application, f"/ws/cluster/?token={raw}")
        for comm in (watch, overview):
            assert (await comm.connect(timeout=WAIT_S))[0]
            await comm.receive_json_from(timeout=WAIT_S)
        await database_sync_to_async(events.publish_job_state)(job, JobState.RUNNING)
        for comm in (watch, overview):
            frame = await comm.receive_json_from(timeout=WAIT_S)
            assert frame["type"] == "job.state"
            assert frame["data"] == {
                "job": job.pk,
                "from": "running",
                "state": "cancelled",
                "reason": "cancelled_by_operator",
                "detail": "",
            }
            await comm.disconnect()

    async_to_sync(scenario)()
