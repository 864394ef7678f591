"""Placing a running job anew at an iteration boundary: colocated <-> disaggregated.

A re-planning policy may decide, from what the job measured, that the next iteration runs
faster with every stage time-sharing all the job's GPUs (colocated), or back on GPUs of their
own (disaggregated). Moving GPUs between groups one migration at a time cannot get there, so the
job is placed anew, as a ``PlacementChange`` row:

    stopping  -- every worker of the job stops (``stop_workers`` with ``redo_from_iteration``:
                 the iteration that just began is redone from its start by the new layout); each
                 device a stop frees is reserved for the change in the same transaction, so no
                 other job is admitted onto it in between
    launching -- once all have stopped, the new layout's workers are created on the reserved
                 devices and launched (``launch_workers``); the iteration's partition of work is
                 drawn anew over them (``agents.services.progress.redo_from``)
    done      -- every new worker runs

A new worker that fails to start fails the job as any failed launch does, and so does a change
that has not finished after ``PLACEMENT_CHANGE_TIMEOUT_S``: the job cannot run half in one
placement and half in the other. Only synchronous jobs are placed anew (the policy never asks
for it while the rollout generates ahead), and only at a boundary with no migration open.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cluster.models import Device, DeviceStatus, NodeStatus, end_reservations
from cluster.selectors import stop_reports
from common import audit, events
from common.audit import Actor
from jobs import agent_commands
from jobs import services as job_services
from jobs.admission import DevicesTaken, allocate_workers
from jobs.models import LIVE_WORKER_STATES, Job, JobReason, JobState, Worker, WorkerGroup, WorkerState
from jobs.placement import core_devices
from jobs.states import transition
from scheduler.core.hypergraph import ComponentKind
from scheduler.core.placement import GroupShape, PlacementFailure, relayout
from scheduler.core.policies.base import Placement, PlacementChange
from scheduler.core.policies.replan import GPU_KINDS
from scheduler.models import OPEN_PLACEMENT_CHANGE_STATES, PlacementChangeState
from scheduler.models import PlacementChange as PlacementChangeRow

log = logging.getLogger(__name__)


def open_change(job: Job) -> PlacementChangeRow | None:
    return PlacementChangeRow.objects.filter(job=job, state__in=OPEN_PLACEMENT_CHANGE_STATES).first()


def start(job: Job, change: PlacementChange, *, actor: Actor) -> PlacementChangeRow | str:
    """Begin placing ``job`` (locked by the caller) as ``change`` says; returns the row, or why
    it cannot be done now (the job then keeps its placement)."""
    groups = _live_groups(job)
    workers = list(
        Worker.objects.filter(group__in=groups, state__in=LIVE_WORKER_STATES)
        .select_related("group")
        .order_by("pk")
    )
    if not workers:
        return "the job has no running workers to place anew"
    starting = [w.name for w in workers if w.state != WorkerState.RUNNING]
    if starting:
        return f"workers still starting: {', '.join(starting)}"
    devices = _job_devices(workers)
    away = sorted({d.node.name for d in devices if d.node.status != NodeStatus.READY})
    if away:
        return f"node {', '.join(away)} is not ready: its workers could not be stopped and started again"
    to = Placement(change.placement)
    layout = relayout(_shapes(groups), core_devices(devices), time_shared=to is Placement.COLOCATED)
    if isinstance(layout, PlacementFailure):
        return f"{layout.group}: {layout.reason}"
    row = PlacementChangeRow.objects.create(
        job=job,
        iteration=job.iteration,
        from_placement=(Placement.DISAGGREGATED if to is Placement.COLOCATED else Placement.COLOCATED).value,
        to_placement=to.value,
        detail=change.detail,
        layout={group: [[d.id for d in worker] for worker in placed] for group, placed in layout.items()},
        old_workers=[w.name for w in workers],
        requested_by=actor.label,
    )
    for worker in workers:
        worker.check_transition(WorkerState.STOPPING)
        worker.state = WorkerState.STOPPING
        worker.save(update_fields=["state"])
    agent_commands.queue_stop(
        workers, reason=f"placing the job anew ({row.to_placement})", redo_from_iteration=job.iteration
    )
    audit.record(actor, "placement_change.started", row, job=job, reason=change.detail)
    _publish(row)
    return row


def on_workers_stopped(job: Job) -> PlacementChangeRow | None:
    """A stop report freed some of the job's workers (in the report's transaction, job locked):
    hold what they freed for the open change, and launch the new layout once all have stopped.
    Returns the change when this report launched it."""
    change = _locked_open(job, PlacementChangeState.STOPPING)
    if change is None:
        return None
    if job.is_terminal:
        _end(
            change, PlacementChangeState.FAILED, f"the job ended ({job.state}) while it was being placed anew"
        )
        return None
    uids = _layout_uids(change)
    Device.objects.filter(uid__in=uids, worker__isnull=True, status=DeviceStatus.FREE, reserved_by="").update(
        reserved_by=change.reservation
    )
    if (
        Worker.objects.filter(name__in=change.old_workers)
        .exclude(state__in=(WorkerState.STOPPED, WorkerState.FAILED))
        .exists()
    ):
        return None
    return change if _launch(job, change) else None


def on_workers_launched(job: Job) -> None:
    """A launch report came in (report's transaction, job locked): the change is done once every
    new worker runs; a new worker that failed has failed the job, and the change with it."""
    change = _locked_open(job, PlacementChangeState.LAUNCHING)
    if change is None:
        return
    states = dict(Worker.objects.filter(name__in=change.new_workers).values_list("name", "state"))
    failed = sorted(name for name, state in states.items() if state == WorkerState.FAILED)
    if failed or job.is_terminal:
        _end(change, PlacementChangeState.FAILED, f"new workers failed to start: {', '.join(failed)}")
        return
    if all(state == WorkerState.RUNNING for state in states.values()):
        _end(change, PlacementChangeState.DONE, "")


def fail_if_stuck(change: PlacementChangeRow, *, now: datetime) -> bool:
    """A change not finished within its time fails the job (tick, job locked). Returns whether
    it did."""
    waited = (now - change.created_at).total_seconds()
    if waited < settings.PLACEMENT_CHANGE_TIMEOUT_S:
        return False
    change = PlacementChangeRow.objects.select_for_update().get(pk=change.pk)
    if change.state not in OPEN_PLACEMENT_CHANGE_STATES:
        return False
    why = f"placing the job anew did not finish within {settings.PLACEMENT_CHANGE_TIMEOUT_S:.0f} s ({change.state})"
    _end(change, PlacementChangeState.FAILED, why)
    job = change.job
    if not job.is_terminal:
        transition(job, JobState.FAILED, JobReason.PLACEMENT_CHANGE_FAILED, Actor.scheduler(), why)
        job_services.release_workers(job, reason=why)
    return True


def _launch(job: Job, change: PlacementChangeRow) -> bool:
    uids = _layout_uids(change)
    by_uid = {d.uid: d for d in Device.objects.select_related("node").filter(uid__in=uids)}
    layout = {
        group: [tuple(core_devices([by_uid[uid] for uid in worker])) for worker in placed]
        for group, placed in change.layout.items()
    }
    try:
        with transaction.atomic():
            launches = allocate_workers(
                job,
                layout,
                by_uid,
                worker_name=lambda group, i: f"j{job.pk}-{group}-p{change.pk}w{i}",
                reservation=change.reservation,
            )
    except DevicesTaken as taken:
        why = f"devices no longer held for the job: {', '.join(taken.uids)}"
        _end(change, PlacementChangeState.FAILED, why)
        transition(job, JobState.FAILED, JobReason.PLACEMENT_CHANGE_FAILED, Actor.scheduler(), why)
        return False
    change.check_transition(PlacementChangeState.LAUNCHING)
    change.state = PlacementChangeState.LAUNCHING
    change.launched_at = timezone.now()
    change.new_workers = [w.name for w in launches]
    change.save(update_fields=["state", "launched_at", "new_workers"])
    agent_commands.queue_launch(launches, job_spec=job.spec)
    # What the nodes said as they stopped the old layout (on Ray: whether the trainer's state was
    # kept for the new one to resume from) is kept with the change's trail.
    stopped = stop_reports(job.pk, redo_from_iteration=change.iteration, since=change.created_at)
    audit.record(
        Actor.scheduler(),
        "placement_change.launching",
        change,
        job=job,
        reason=change.detail,
        payload={"stop_reports": stopped},
    )
    _publish(change)
    return True


def _end(change: PlacementChangeRow, state: str, error: str) -> None:
    change.check_transition(state)
    change.state = state
    change.error = error
    change.finished_at = timezone.now()
    change.save(update_fields=["state", "error", "finished_at"])
    end_reservations(change.reservation)
    verb = "placement_change.done" if state == PlacementChangeState.DONE else "placement_change.failed"
    audit.record(Actor.scheduler(), verb, change, job=change.job, reason=error or change.detail)
    if error:
        log.warning("job %s: %s", change.job_id, error)
    _publish(change)


def _locked_open(job: Job, state: str) -> PlacementChangeRow | None:
    return PlacementChangeRow.objects.select_for_update().filter(job=job, state=state).first()


def _live_groups(job: Job) -> list[WorkerGroup]:
    """The groups with live workers: all of them are placed anew (every group holds devices)."""
    ids = set(
        Worker.objects.filter(state__in=LIVE_WORKER_STATES, group__job=job).values_list("group_id", flat=True)
    )
    return list(WorkerGroup.objects.filter(pk__in=ids).order_by("pk"))


def _job_devices(workers: Iterable[Worker]) -> list[Device]:
    seen: dict[str, Device] = {}
    for worker in workers:
        for device in [
            *worker.devices.select_related("node"),
            *worker.colocated_devices.select_related("node"),
        ]:
            seen.setdefault(device.uid, device)
    return list(seen.values())


def _shapes(groups: Iterable[WorkerGroup]) -> list[GroupShape]:
    return [
        GroupShape(
            name=g.name,
            gpus_per_worker=g.gpus_per_worker,
            min_workers=g.min_workers,
            max_workers=g.max_workers,
            valid_dp=tuple(int(n) for n in g.valid_dp),
            hardware=tuple(g.hardware),
            split_gpus=g.initial_workers * g.gpus_per_worker,
            spreads=ComponentKind(g.kind) in GPU_KINDS,
        )
        for g in groups
    ]


def _layout_uids(change: PlacementChangeRow) -> set[str]:
    return {uid for placed in change.layout.values() for worker in placed for uid in worker}


def _publish(change: PlacementChangeRow) -> None:
    events.publish(
        "placement_change",
        {
            "id": change.pk,
            "state": change.state,
            "from": change.from_placement,
            "to": change.to_placement,
            "iteration": change.iteration,
            "detail": change.detail,
            "error": change.error,
        },
        job_id=change.job_id,
    )
