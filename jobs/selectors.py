"""Read-side queries over jobs and their worker groups."""

from __future__ import annotations

from django.db.models import Count, Prefetch, QuerySet

from cluster.models import Device
from jobs.models import CURRENT_WORKER_STATES, IterationResult, Job, Worker, WorkerGroup


def with_allocation(groups: QuerySet[WorkerGroup]) -> QuerySet[WorkerGroup]:
    """Groups with their current workers (as ``current_workers``), devices and latest signals."""
    devices = Device.objects.select_related("node").order_by("node__name", "index")
    current = (
        Worker.objects.filter(state__in=CURRENT_WORKER_STATES)
        .order_by("id")
        .prefetch_related(
            Prefetch("devices", queryset=devices), Prefetch("colocated_devices", queryset=devices)
        )
    )
    return groups.select_related("signals").prefetch_related(
        Prefetch("workers", queryset=current, to_attr="current_workers")
    )


def jobs_with_gpus() -> QuerySet[Job]:
    """Jobs with their owner and the number of devices their workers hold (``allocated_gpus``)."""
    return Job.objects.select_related("owner").annotate(
        allocated_gpus=Count("groups__workers__devices", distinct=True)
    )


def iteration_results(job: Job) -> QuerySet[IterationResult]:
    """A real job's iteration results, oldest first."""
    return IterationResult.objects.filter(job=job).order_by("iteration")
