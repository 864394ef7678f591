"""Read-side queries that span the apps, for the API, the WebSocket consumers and the dashboard.

``cluster_summary``: the cluster at a glance: GPUs by state, hardware, job and component; nodes;
jobs; the queue. A lost node's devices count as lost, owned ones included: they stay in their
job's GPUs (the worker keeps them until the node comes back or the job lets them go) and are also
counted as the job's and component's ``lost``.

``job_hello`` and ``cluster_hello``: what a WebSocket client sees on connect (and on resync).

``nodes_with_device_counts`` and ``devices_with_holders``: the node and device lists.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from django.db.models import Avg, Count, Prefetch, Q, QuerySet

from cluster.models import Device, DeviceStatus, Node, NodeStatus
from jobs.models import CURRENT_WORKER_STATES, Job, JobState, Worker
from scheduler.alerts import alert_json
from scheduler.models import (
    OPEN_MIGRATION_STATES,
    Alert,
    AlertKind,
    HypergraphSnapshot,
    Migration,
    SchedulingDecision,
)


def _zero_filled(choices: list[str], counts: dict[str, int]) -> dict[str, int]:
    return {choice: counts.get(choice, 0) for choice in choices} | counts


def cluster_summary() -> dict[str, Any]:
    device_states = [s.value for s in DeviceStatus]
    by_status = dict(Device.objects.values_list("status").annotate(n=Count("id")).order_by())

    hardware: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(device_states, 0))
    for hw, state, n in Device.objects.values_list("hardware", "status").annotate(n=Count("id")).order_by():
        hardware[hw][state] = n

    jobs: dict[int, dict[str, Any]] = {}
    owned = (
        Device.objects.filter(worker__isnull=False)
        .values_list(
            "worker__group__job_id",
            "worker__group__job__name",
            "worker__group__job__state",
            "worker__group__name",
            "worker__group__kind",
        )
        .annotate(n=Count("id"), lost=Count("id", filter=Q(status=DeviceStatus.LOST)))
        .order_by("worker__group__job_id", "worker__group__name")
    )
    for job_id, job_name, job_state, group, kind, n, lost in owned:
        entry = jobs.setdefault(
            job_id,
            {"job": job_id, "name": job_name, "state": job_state, "gpus": 0, "lost": 0, "components": []},
        )
        entry["gpus"] += n
        entry["lost"] += lost
        entry["components"].append({"group": group, "kind": kind, "gpus": n, "lost": lost})

    node_states = dict(Node.objects.values_list("status").annotate(n=Count("id")).order_by())
    job_states = dict(Job.objects.values_list("state").annotate(n=Count("id")).order_by())
    return {
        "gpus": {
            "total": sum(by_status.values()),
            "by_status": _zero_filled(device_states, by_status),
            "by_hardware": [
                {"hardware": hw, "total": sum(states.values()), **states}
                for hw, states in sorted(hardware.items())
            ],
            "by_job": sorted(jobs.values(), key=lambda j: (-j["gpus"], j["job"])),
        },
        "nodes": {
            "total": sum(node_states.values()),
            "by_status": _zero_filled([s.value for s in NodeStatus], node_states),
        },
        "jobs": {
            "total": sum(job_states.values()),
            "by_state": _zero_filled([s.value for s in JobState], job_states),
            "queue_length": job_states.get(JobState.PENDING, 0),
        },
        "migrations_in_flight": Migration.objects.filter(state__in=OPEN_MIGRATION_STATES).count(),
        "open_alerts": Alert.objects.filter(cleared_at__isnull=True).count(),
    }


def job_hello(job_id: int) -> dict[str, Any] | None:
    """The job's current state for a (re)connecting client; None when there is no such job."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return None
    snapshot = (
        HypergraphSnapshot.objects.filter(job=job)
        .order_by("-taken_at", "-id")
        .values("id", "taken_at")
        .first()
    )
    decision_id = (
        SchedulingDecision.objects.filter(job=job).order_by("-at", "-id").values_list("id", flat=True).first()
    )
    migration = (
        Migration.objects.filter(job=job, state__in=OPEN_MIGRATION_STATES)
        .order_by("-created_at", "-id")
        .values("id", "migration_id", "state", "strategy", "donor", "recipient")
        .first()
    )
    alerts = Alert.objects.filter(job=job, cleared_at__isnull=True).order_by("-raised_at")
    return {
        "scope": "job",
        "job": {
            "id": job.pk,
            "name": job.name,
            "state": job.state,
            "state_reason": job.state_reason,
            "state_detail": job.state_detail,
            "policy": job.policy,
            "iteration": job.iteration,
            "iterations_total": job.iterations_total,
            "tokens_per_s": job.tokens_per_s,
            "total_gpus": job.total_gpus,
        },
        "latest_snapshot_id": snapshot["id"] if snapshot else None,
        "latest_snapshot_at": snapshot["taken_at"].isoformat() if snapshot else None,
        "last_decision_id": decision_id,
        "open_migration": migration,
        "open_alerts": [alert_json(a) for a in alerts],
    }


def _counts(rows: Any, field: str, keys: list[str]) -> dict[str, int]:
    """``{key: count}`` with every key present, zero when no row has it."""
    counted = Counter({row[field]: row["n"] for row in rows})
    return {key: int(counted.get(key, 0)) for key in keys}


def cluster_hello() -> dict[str, Any]:
    """Summary counts of the whole cluster for a (re)connecting overview."""
    jobs = _counts(Job.objects.values("state").annotate(n=Count("id")), "state", list(JobState.values))
    gpus = _counts(
        Device.objects.values("status").annotate(n=Count("id")), "status", list(DeviceStatus.values)
    )
    nodes = _counts(Node.objects.values("status").annotate(n=Count("id")), "status", list(NodeStatus.values))
    alerts = _counts(
        Alert.objects.filter(cleared_at__isnull=True).values("kind").annotate(n=Count("id")),
        "kind",
        list(AlertKind.values),
    )
    return {
        "scope": "cluster",
        "jobs": jobs,
        "queue_length": jobs[JobState.PENDING],
        "gpus": gpus,
        "nodes": nodes,
        "migrations_in_flight": Migration.objects.filter(state__in=OPEN_MIGRATION_STATES).count(),
        "open_alerts": alerts,
    }


def nodes_with_device_counts() -> QuerySet[Node]:
    """Nodes with their devices counted by status and their mean utilisation."""
    return (
        Node.objects.annotate(
            devices_total=Count("devices", distinct=True),
            devices_free=Count("devices", filter=Q(devices__status=DeviceStatus.FREE), distinct=True),
            devices_allocated=Count(
                "devices", filter=Q(devices__status=DeviceStatus.ALLOCATED), distinct=True
            ),
            devices_lost=Count("devices", filter=Q(devices__status=DeviceStatus.LOST), distinct=True),
            utilisation_mean=Avg("devices__utilisation"),
        )
        .prefetch_related(Prefetch("devices", queryset=Device.objects.only("id", "node_id", "hardware")))
        .order_by("name")
    )


def devices_with_holders() -> QuerySet[Device]:
    """Devices with their node, owning worker, group and job, and the workers time-sharing them."""
    return (
        Device.objects.select_related("node", "worker__group__job")
        .prefetch_related(
            Prefetch(
                "colocated_workers",
                queryset=Worker.objects.filter(state__in=CURRENT_WORKER_STATES).select_related("group"),
            )
        )
        .order_by("node__name", "index")
    )
