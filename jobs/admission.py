"""Gang admission: a job gets devices for all its groups at once, or waits.

Pending jobs are taken by priority, then age. Admission is serialised cluster-wide with a
PostgreSQL advisory lock so two workers never hand out the same device. What is free comes from
the one selector the tick's free pool uses too (``cluster.selectors.free_devices``): devices an open
migration has reserved are not free, and a device reserved while admission runs is not taken
(the allocation is a conditional update; the job waits for the next round instead).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from django.db import connection, transaction
from django.db.models import Q

from cluster.models import FREE_DEVICE, Device, DeviceStatus, NodeStatus
from cluster.selectors import free_devices
from common.audit import Actor
from jobs import agent_commands
from jobs.models import Job, JobReason, JobState, Worker, WorkerGroup
from jobs.placement import backend_devices, core_devices, group_requests, never_fits, registered_devices
from jobs.spec import JobSpec
from jobs.states import transition
from scheduler.core.placement import Placement, PlacementFailure, place

ADMISSION_LOCK_KEY = 0x64796E61  # "dyna"


def admit_pending(*, actor: Actor) -> list[Job]:
    """Admit as many pending jobs as fit, highest priority first; returns the admitted ones."""
    admitted: list[Job] = []
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ADMISSION_LOCK_KEY])
        # Devices of ready nodes that are not lost are handed out; but ranks count over every
        # registered device, and a job is refused as never fitting only if the whole cluster
        # could not hold it: lost and drained nodes may come back.
        cluster = registered_devices()
        free_uids = set(free_devices().values_list("uid", flat=True))
        # Backends whose pending jobs wait behind a job of higher priority that shares their nodes.
        held_back: set[str] = set()
        for job in (
            Job.objects.select_for_update(no_key=True)
            .filter(state=JobState.PENDING)
            .order_by("-priority", "submitted_at", "id")
        ):
            spec = JobSpec.from_json(job.spec)
            if spec.backend in held_back:
                continue
            requests = group_requests(spec)
            # A job runs only where the node's agent runs its backend (a ray job never on sim hosts).
            pool = backend_devices(cluster, spec.backend)
            free = [d for d in pool if d.uid in free_uids]
            result = place(requests, core_devices(free), core_devices(pool))
            if isinstance(result, PlacementFailure):
                never = never_fits(requests, cluster, spec.backend)
                if never is not None:
                    transition(
                        job,
                        JobState.FAILED,
                        JobReason.UNSCHEDULABLE,
                        actor,
                        f"{never.group}: {never.reason} (the cluster changed since submission)",
                    )
                    continue
                detail = _waiting_detail(spec.backend, result, cluster)
                if job.state_detail != detail:
                    job.state_reason, job.state_detail = JobReason.WAITING_FOR_DEVICES, detail
                    job.save(update_fields=["state_reason", "state_detail"])
                # Strict priority order: a job that waits holds back the ones behind it that could
                # use the same nodes, so a large job is never starved by a stream of small ones.
                held_back.add(spec.backend)
                held_back.update(b for d in pool for b in d.node.backends)
                continue
            try:
                with transaction.atomic():
                    launches = _allocate(job, result, {d.uid: d for d in cluster})
            except DevicesTaken as taken:
                # Reserved by a migration after this round read the free pool: wait for the next.
                detail = f"waiting for devices: {', '.join(taken.uids)} were reserved meanwhile"
                job.state_reason, job.state_detail = JobReason.WAITING_FOR_DEVICES, detail
                job.save(update_fields=["state_reason", "state_detail"])
                held_back.add(spec.backend)
                continue
            for devices in launches.values():
                free_uids.difference_update(d.uid for d in devices)
            transition(job, JobState.ADMITTED, JobReason.ADMITTED, actor, f"{spec.total_gpus} GPUs")
            agent_commands.queue_launch(launches, job_spec=job.spec)
            admitted.append(job)
    return admitted


class DevicesTaken(Exception):
    def __init__(self, uids: list[str]) -> None:
        super().__init__(", ".join(uids))
        self.uids = uids


def _allocate(job: Job, placement: Placement, by_uid: dict[str, Device]) -> dict[Worker, list[Device]]:
    return allocate_workers(job, placement, by_uid, worker_name=lambda group, i: f"j{job.pk}-{group}-w{i}")


def allocate_workers(
    job: Job,
    placement: Placement,
    by_uid: Mapping[str, Device],
    *,
    worker_name: Callable[[str, int], str],
    reservation: str = "",
) -> dict[Worker, list[Device]]:
    """Create the job's workers and give them their devices: free ones, or the ones held for the
    job under ``reservation`` (a re-placement). A device placed for more than one worker is owned
    by the first and time-shared by the others (a colocated placement). Raises DevicesTaken (and
    the caller's savepoint undoes everything) when a device stopped being available meanwhile."""
    available = (
        FREE_DEVICE
        if not reservation
        else Q(
            status=DeviceStatus.FREE,
            worker__isnull=True,
            reserved_by=reservation,
            node__status=NodeStatus.READY,
        )
    )
    launches: dict[Worker, list[Device]] = {}
    for group in WorkerGroup.objects.filter(job=job):
        for i, worker_devices in enumerate(placement.get(group.name, [])):
            worker = Worker.objects.create(group=group, name=worker_name(group.name, i))
            devices = [by_uid[d.id] for d in worker_devices]
            owned = [d for d in devices if d.worker_id is None]
            shared = [d for d in devices if d.worker_id is not None]
            got = Device.objects.filter(available, pk__in=[d.pk for d in owned]).update(
                worker=worker, status=DeviceStatus.ALLOCATED, reserved_by=""
            )
            if got != len(owned):
                still = set(
                    Device.objects.filter(available, pk__in=[d.pk for d in owned]).values_list(
                        "uid", flat=True
                    )
                )
                raise DevicesTaken(sorted(d.uid for d in owned if d.uid not in still))
            for d in owned:
                d.status, d.worker_id = DeviceStatus.ALLOCATED, worker.pk
            if shared:
                worker.colocated_devices.add(*shared)
            launches[worker] = devices
    return launches


def _waiting_detail(backend: str, failure: PlacementFailure, cluster: list[Device]) -> str:
    """What a pending job waits for, for the operator: a node running its backend, or devices."""
    ready = {d.node.name: d.node for d in cluster if d.node.status == NodeStatus.READY}
    if not any(node.offers(backend) for node in ready.values()):
        others = sorted({b for node in ready.values() for b in node.backends})
        return f"waiting for a node whose agent runs the {backend!r} backend: no ready node offers it" + (
            f" (ready nodes run {', '.join(others)})" if others else ""
        )
    detail = f"waiting for devices: {failure.group}: {failure.reason}"
    if not all(node.offers(backend) for node in ready.values()):
        detail += f" (on the nodes running the {backend!r} backend)"
    return detail
