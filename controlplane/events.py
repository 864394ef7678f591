"""Live events to browsers over the Channels layer (Redis).

Groups: ``job.<id>`` for one job's page, ``cluster`` for the overview. Event types are typed
strings (job.state, snapshot, decision, migration.step, telemetry, alert); the payload is JSON.
Publishing never fails the caller: a mutation has already committed when it publishes.
``controlplane.consumers`` forwards them to WebSocket clients (the frame format is described there).

Besides ``publish``, this module builds two payloads that have no single mutation behind them:
``publish_job_state`` (for whoever changes a job's state) and the periodic telemetry roll-ups
(``publish_telemetry_rollups``, run by beat), read from the signals the last tick stored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.utils import timezone

log = logging.getLogger(__name__)

EVENT_TYPES = frozenset(
    {"job.state", "snapshot", "decision", "migration", "migration.step", "telemetry", "alert"}
)


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


CLUSTER_GROUP = "cluster"


def _send(group: str, event_type: str, data: Mapping[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    message = {
        "type": "dynarl.event",
        "event": event_type,
        "at": timezone.now().isoformat(),
        "data": dict(data),
    }
    try:
        async_to_sync(layer.group_send)(group, message)
    except Exception:  # the broker being down must not undo a committed change
        log.warning("could not publish %s to %s", event_type, group, exc_info=True)


def publish(
    event_type: str, data: Mapping[str, Any], *, job_id: int | None = None, cluster: bool = False
) -> None:
    """Send after the current transaction commits (at once when there is none)."""
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}")

    def send() -> None:
        if job_id is not None:
            _send(job_group(job_id), event_type, data)
        if cluster:
            _send(CLUSTER_GROUP, event_type, data)

    transaction.on_commit(send)


def publish_job_state(job: Any, previous: str) -> None:
    """A job changed state (call inside the transaction that changed it): its page and the overview."""
    publish(
        "job.state",
        {
            "job": job.pk,
            "from": previous,
            "state": job.state,
            "reason": job.state_reason,
            "detail": job.state_detail,
        },
        job_id=job.pk,
        cluster=True,
    )


# Fields of scheduler.core.signals.GroupSignals a live chart plots (not the per-worker id lists).
ROLLUP_FIELDS = (
    "workers",
    "utilisation_mean",
    "utilisation_p90",
    "low_utilisation_fraction",
    "queue_length",
    "in_flight",
    "tokens_per_s",
    "progress",
    "busy",
)


def publish_telemetry_rollups(now: Any = None) -> int:
    """One ``telemetry`` event per job whose signals a tick refreshed in the last
    ``TELEMETRY_ROLLUP_S`` (per-group utilisation, queue, tokens/s), and one for the overview
    (GPUs by status, mean utilisation of the allocated ones reporting, running jobs' tokens/s).
    Returns the number of job roll-ups sent."""
    from django.db.models import Avg, Count, Sum

    from agents.models import Device, DeviceStatus
    from jobs.models import Job, JobState
    from scheduler.models import GroupSignalsRecord

    now = now or timezone.now()
    since = now - timedelta(seconds=settings.TELEMETRY_ROLLUP_S)
    records = (
        GroupSignalsRecord.objects.filter(
            computed_at__gt=since, group__job__state__in=(JobState.RUNNING, JobState.PAUSED_SCHEDULING)
        )
        .select_related("group", "group__job")
        .order_by("group__job_id", "group__name")
    )
    rollups: dict[int, dict[str, Any]] = {}
    for record in records:
        job = record.group.job
        rollup = rollups.setdefault(
            job.pk,
            {
                "scope": "job",
                "job": job.pk,
                "computed_at": record.computed_at.isoformat(),
                "iteration": job.iteration,
                "tokens_per_s": job.tokens_per_s,
                "groups": {},
            },
        )
        rollup["computed_at"] = max(rollup["computed_at"], record.computed_at.isoformat())
        signals = record.data
        rollup["groups"][record.group.name] = {
            "kind": record.group.kind,
            **{name: signals.get(name) for name in ROLLUP_FIELDS},
        }
    for job_id, rollup in rollups.items():
        publish("telemetry", rollup, job_id=job_id)

    gpus = {status: 0 for status in DeviceStatus.values}
    for row in Device.objects.values("status").annotate(n=Count("id")).order_by():
        gpus[row["status"]] = row["n"]
    # Devices silent for longer are in a heartbeat gap: their last reading says nothing now.
    fresh = now - timedelta(seconds=settings.ALERT_HEARTBEAT_GAP_S)
    utilisation = Device.objects.filter(status=DeviceStatus.ALLOCATED, reported_at__gt=fresh).aggregate(
        mean=Avg("utilisation")
    )["mean"]
    running = Job.objects.filter(state__in=(JobState.RUNNING, JobState.PAUSED_SCHEDULING)).aggregate(
        jobs=Count("id"), tokens=Sum("tokens_per_s")
    )
    publish(
        "telemetry",
        {
            "scope": "cluster",
            "computed_at": now.isoformat(),
            "gpus": gpus,
            "allocated_utilisation_mean": utilisation,
            "running_jobs": running["jobs"],
            "tokens_per_s": running["tokens"] or 0.0,
        },
        cluster=True,
    )
    return len(rollups)
