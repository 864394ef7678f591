"""Periodic telemetry roll-ups for the browsers (beat runs them every ``TELEMETRY_ROLLUP_S``): per
job, the signals its last tick stored; for the overview, GPUs by status and the running jobs'
throughput."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Avg, Count, Sum
from django.utils import timezone

from cluster.models import Device, DeviceStatus
from common import events
from jobs.models import Job, JobState
from scheduler.models import GroupSignalsRecord

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
        events.publish("telemetry", rollup, job_id=job_id)

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
    events.publish(
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
