"""Read-side queries of the scheduler: a job's history for its page, which component held each
GPU over time (the ownership timeline), and per-group utilisation and throughput over time (from
the telemetry buckets).

Devices keep only their current owner, so the timeline is rebuilt from what was recorded along
the way: every worker row (its group, when it was created and stopped), the devices each worker
held (its devices now, the hypergraph snapshots it appears in, and the steps of the migrations that
started or released it) and the migrations themselves, which mark the moments devices changed hands.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Avg, Count, Min, Sum
from django.utils import timezone

from cluster.models import Device
from jobs.models import IterationResult, Job, Worker, WorkerState
from scheduler.core.hypergraph import ComponentKind
from scheduler.core.migration import StepKind
from scheduler.core.signals import MeasuredIteration
from scheduler.models import (
    HypergraphSnapshot,
    Migration,
    MigrationStep,
    PlacementChange,
    TelemetrySample,
)

# Step kinds whose device list is the devices of the workers they start or let go.
OWNERSHIP_STEP_KINDS = frozenset(
    {
        StepKind.START_WORKERS.value,
        StepKind.STOP_WORKERS.value,
        StepKind.RELEASE_DEVICES.value,
        StepKind.DESTROY_OLD.value,
    }
)
# The telemetry history a page asks for when it names no start.
DEFAULT_TELEMETRY_WINDOW = timedelta(hours=1)


# --- GPU ownership timeline --------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceRow:
    uid: str
    node: str
    index: int
    hardware: str


@dataclass(frozen=True)
class Ownership:
    """One worker holding one device from ``start`` until ``end`` (None: it still does)."""

    device: str
    worker: str
    group: str
    kind: str
    start: datetime
    end: datetime | None
    colocated: bool = False  # time-shared with another worker of the job (verl-style)


@dataclass(frozen=True)
class MigrationMark:
    id: int
    migration_id: str
    state: str
    strategy: str
    donor: str
    recipient: str
    device_uids: tuple[str, ...]
    requested_by: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True)
class Timeline:
    job: int
    start: datetime
    end: datetime
    devices: tuple[DeviceRow, ...]
    segments: tuple[Ownership, ...]
    migrations: tuple[MigrationMark, ...]


@dataclass
class _Holdings:
    owned: set[str] = field(default_factory=set)
    colocated: set[str] = field(default_factory=set)


def _split_evenly(device_uids: Sequence[str], worker_names: Sequence[str]) -> dict[str, list[str]]:
    """The planner gives each worker of a step an equal, consecutive share of its devices."""
    if not worker_names or len(device_uids) % len(worker_names):
        return {}
    per_worker = len(device_uids) // len(worker_names)
    return {
        name: list(device_uids[k * per_worker : (k + 1) * per_worker]) for k, name in enumerate(worker_names)
    }


def _holdings(job: Job, workers: Iterable[Worker]) -> dict[str, _Holdings]:
    """worker name -> the devices it held at some point, from every record that says so."""
    held: dict[str, _Holdings] = defaultdict(_Holdings)
    for worker in workers:
        held[worker.name].owned.update(d.uid for d in worker.devices.all())
        held[worker.name].colocated.update(d.uid for d in worker.colocated_devices.all())
    for data in HypergraphSnapshot.objects.filter(job=job).values_list("data", flat=True).iterator():
        for node in data.get("nodes", []):
            for worker_json in node.get("workers", []):
                held[worker_json["id"]].owned.update(d["id"] for d in worker_json.get("devices", []))
    steps = MigrationStep.objects.filter(migration__job=job, kind__in=OWNERSHIP_STEP_KINDS, is_rollback=False)
    for device_uids, worker_names in steps.values_list("device_uids", "worker_names"):
        for name, uids in _split_evenly(device_uids, worker_names).items():
            held[name].owned.update(uids)
    for holding in held.values():
        # A snapshot lists a colocated worker's shared devices among its own; keep them marked.
        holding.owned -= holding.colocated
    return held


def _worker_end(worker: Worker, job: Job) -> datetime | None:
    if worker.stopped_at is not None:
        return worker.stopped_at
    if worker.state in (WorkerState.STOPPED, WorkerState.FAILED) or job.is_terminal:
        # Stopped without a recorded time: it held its devices at most until the job ended.
        return job.finished_at or job.last_tick_at or worker.started_at or worker.created_at
    return None


def job_timeline(job: Job, *, now: datetime | None = None) -> Timeline:
    """Every (device, worker) holding of the job, ordered by device then time, with the job's
    migrations (their device lists say which rows each one touched)."""
    now = now or timezone.now()
    workers = list(
        Worker.objects.filter(group__job=job)
        .select_related("group")
        .prefetch_related("devices", "colocated_devices")
        .order_by("created_at", "id")
    )
    held = _holdings(job, workers)
    segments: list[Ownership] = []
    for worker in workers:
        start, end = worker.created_at, _worker_end(worker, job)
        holding = held.get(worker.name, _Holdings())
        for uid, colocated in [*((u, False) for u in holding.owned), *((u, True) for u in holding.colocated)]:
            segments.append(
                Ownership(
                    device=uid,
                    worker=worker.name,
                    group=worker.group.name,
                    kind=worker.group.kind,
                    start=start,
                    end=end if end is None or end >= start else start,
                    colocated=colocated,
                )
            )
    migrations = tuple(
        MigrationMark(
            id=m.pk,
            migration_id=m.migration_id,
            state=m.state,
            strategy=m.strategy,
            donor=m.donor,
            recipient=m.recipient,
            device_uids=tuple(m.device_uids),
            requested_by=m.requested_by,
            created_at=m.created_at,
            started_at=m.started_at,
            finished_at=m.finished_at,
        )
        for m in Migration.objects.filter(job=job).order_by("created_at", "id")
    )
    uids = {s.device for s in segments} | {uid for m in migrations for uid in m.device_uids}
    devices = tuple(
        DeviceRow(uid=d.uid, node=d.node.name, index=d.index, hardware=d.hardware)
        for d in Device.objects.filter(uid__in=uids).select_related("node").order_by("node__name", "index")
    )
    known = {d.uid for d in devices}
    # A device deleted since (its node removed) still has its history.
    devices += tuple(DeviceRow(uid=uid, node="", index=0, hardware="") for uid in sorted(uids - known))
    order = {d.uid: k for k, d in enumerate(devices)}
    segments.sort(key=lambda s: (order[s.device], s.start, s.worker))
    starts = [s.start for s in segments]
    start = job.admitted_at or (min(starts) if starts else job.submitted_at)
    end = job.finished_at if job.is_terminal and job.finished_at else now
    return Timeline(
        job=job.pk,
        start=min([start, *starts]),
        end=max(end, start),
        devices=devices,
        segments=tuple(segments),
        migrations=migrations,
    )


# --- utilisation and throughput per group ------------------------------------------------------


@dataclass(frozen=True)
class TelemetryPoint:
    """One telemetry bucket of one group: its workers' mean utilisation and summed throughput."""

    at: datetime  # the bucket's start
    workers: int
    utilisation_mean: float
    utilisation_min: float
    tokens_per_s: float
    queue_length: int
    in_flight: int
    waiting_mean: float | None = None


@dataclass(frozen=True)
class GroupSeries:
    group: str
    kind: str
    points: tuple[TelemetryPoint, ...]


@dataclass(frozen=True)
class TelemetryHistory:
    job: int
    since: datetime
    until: datetime
    bucket_s: float
    groups: tuple[GroupSeries, ...]


def job_telemetry(
    job: Job, *, since: datetime | None = None, now: datetime | None = None
) -> TelemetryHistory:
    """Per-group series from the job's TelemetrySample buckets at or after ``since`` (default: the
    last hour). A bucket still filling divides its tokens by the time elapsed in it, so the newest
    point is not understated."""
    now = now or timezone.now()
    since = since or now - DEFAULT_TELEMETRY_WINDOW
    bucket_s = float(settings.TELEMETRY_BUCKET_S)
    rows = (
        TelemetrySample.objects.filter(job=job, bucket_start__gte=since)
        .values("group", "bucket_start")
        .annotate(
            workers=Count("worker", distinct=True),
            utilisation_mean=Avg("utilisation_mean"),
            utilisation_min=Min("utilisation_min"),
            tokens=Sum("tokens"),
            queue_length=Sum("queue_length"),
            in_flight=Sum("in_flight"),
            waiting_mean=Avg("waiting_mean"),
        )
        .order_by("group", "bucket_start")
    )
    kinds = dict(job.groups.values_list("name", "kind"))
    points: dict[str, list[TelemetryPoint]] = {name: [] for name in kinds}
    for row in rows:
        elapsed = (now - row["bucket_start"]).total_seconds()
        span = min(bucket_s, elapsed) if elapsed > 0 else bucket_s
        points.setdefault(row["group"], []).append(
            TelemetryPoint(
                at=row["bucket_start"],
                workers=row["workers"],
                utilisation_mean=float(row["utilisation_mean"] or 0.0),
                utilisation_min=float(row["utilisation_min"] or 0.0),
                tokens_per_s=float(row["tokens"] or 0) / max(span, 1e-3),
                queue_length=int(row["queue_length"] or 0),
                in_flight=int(row["in_flight"] or 0),
                waiting_mean=None if row["waiting_mean"] is None else float(row["waiting_mean"]),
            )
        )
    return TelemetryHistory(
        job=job.pk,
        since=since,
        until=now,
        bucket_s=bucket_s,
        groups=tuple(
            GroupSeries(group=name, kind=kinds.get(name, ""), points=tuple(series))
            for name, series in points.items()
        ),
    )


def latest_measured_iteration(job: Job) -> MeasuredIteration | None:
    """The job's latest finished iteration as its driver measured it (a real runtime reports
    each phase's seconds in its iteration result), or None before one or for a simulated job.

    Its duration runs from the previous iteration's result to its own, less the time the job
    spent being placed anew in between (that is the switch's, not the iteration's). Without the
    previous iteration's result (the job's first), it is the sum of its phases: what came before
    them was the job's setup (workers starting, the warm start loading), not the iteration."""
    rows = list(IterationResult.objects.filter(job=job).order_by("-iteration")[:2])
    if not rows or not isinstance(rows[0].metrics.get("seconds"), dict):
        return None
    latest = rows[0]
    phases = latest.metrics["seconds"]
    previous = rows[1] if len(rows) > 1 and rows[1].iteration == latest.iteration - 1 else None
    if previous is None:
        duration = sum(float(value) for value in phases.values())
    else:
        changes = PlacementChange.objects.filter(
            job=job, finished_at__gt=previous.recorded_at, finished_at__lte=latest.recorded_at
        )
        replacing = sum((c.finished_at - c.created_at).total_seconds() for c in changes if c.finished_at)
        duration = (latest.recorded_at - previous.recorded_at).total_seconds() - replacing
    if duration <= 0:
        return None
    return MeasuredIteration(
        iteration=latest.iteration,
        duration_s=duration,
        generate_s=float(phases.get("generate", 0.0)),
        busy_s={
            ComponentKind.INFERENCE: float(phases.get("reference", 0.0)),
            ComponentKind.ACTOR: float(phases.get("train", 0.0)) + float(phases.get("push", 0.0)),
        },
        tokens=float(latest.metrics.get("tokens_trained", 0.0)),
    )
