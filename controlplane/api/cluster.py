"""The cluster at a glance: GPUs by state, hardware, job and component; nodes; jobs; the queue.

A lost node's devices count as lost, owned ones included: they stay in their job's GPUs (the
worker keeps them until the node comes back or the job lets them go) and are also counted as the
job's and component's ``lost``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.db.models import Count, Q

from agents.models import Device, DeviceStatus, Node, NodeStatus
from jobs.models import Job, JobState
from scheduler.models import OPEN_MIGRATION_STATES, Alert, Migration


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
