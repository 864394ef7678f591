"""Job lifecycle: submission (then admission), cancellation, pausing and resuming the scheduler.

Every state change goes through ``jobs.states.transition`` under the job's row lock.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from cluster.models import Device, release_devices
from common import audit
from common.audit import Actor
from jobs import agent_commands
from jobs.admission import admit_pending
from jobs.models import (
    LIVE_WORKER_STATES,
    IterationResult,
    Job,
    JobReason,
    JobState,
    JobTransition,
    Worker,
    WorkerGroup,
    WorkerState,
)
from jobs.placement import group_requests, never_fits, registered_devices
from jobs.spec import DocumentLimits, parse_spec
from jobs.states import transition
from scheduler.core.hypergraph import DEFAULT_INTERRUPTIBILITY, DEFAULT_SCALING


class SubmissionRefused(Exception):
    """The spec is valid but the job can never run on this cluster."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different spec."""


@dataclass(frozen=True)
class Submission:
    job: Job
    created: bool


def spec_limits() -> DocumentLimits:
    """The bounds a submitted spec is read within (the JOB_SPEC_MAX_* settings)."""
    return DocumentLimits(
        max_bytes=settings.JOB_SPEC_MAX_BYTES,
        max_depth=settings.JOB_SPEC_MAX_DEPTH,
        max_nodes=settings.JOB_SPEC_MAX_NODES,
        max_aliases=settings.JOB_SPEC_MAX_ALIASES,
    )


def fingerprint(source: str | Mapping[str, Any]) -> str:
    canonical = (
        source if isinstance(source, str) else json.dumps(source, sort_keys=True, separators=(",", ":"))
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def submit_job(
    *, owner: Any, source: str | Mapping[str, Any], actor: Actor, idempotency_key: str = ""
) -> Submission:
    """Validate and record a job, then try to admit it. Raises jobs.spec.SpecError on a bad spec."""
    print_ = fingerprint(source)
    if idempotency_key:
        existing = Job.objects.filter(owner=owner, idempotency_key=idempotency_key).first()
        if existing is not None:
            if existing.idempotency_fingerprint != print_:
                raise IdempotencyConflict(idempotency_key)
            return Submission(existing, created=False)

    spec = parse_spec(source, limits=spec_limits())
    failure = never_fits(group_requests(spec), registered_devices(), spec.backend)
    if failure is not None:
        raise SubmissionRefused(
            f"components.{failure.group}", f"can never fit on this cluster: {failure.reason}"
        )

    try:
        with transaction.atomic():
            job = Job.objects.create(
                owner=owner,
                name=spec.name,
                spec=spec.to_json(),
                spec_source=source if isinstance(source, str) else json.dumps(source, indent=2),
                spec_format=spec.source_format,
                priority=spec.priority,
                policy=spec.policy.name,
                backend=spec.backend,
                total_gpus=spec.total_gpus,
                tick_seconds=spec.tick_seconds,
                iterations_total=spec.workload.iterations,
                idempotency_key=idempotency_key,
                idempotency_fingerprint=print_,
            )
            for component in spec.components:
                WorkerGroup.objects.create(
                    job=job,
                    name=component.name,
                    kind=component.kind.value,
                    scaling=DEFAULT_SCALING[component.kind].value,
                    interruptibility=DEFAULT_INTERRUPTIBILITY[component.kind].value,
                    tp=component.tp,
                    pp=component.pp,
                    valid_dp=list(component.valid_dp),
                    min_workers=component.min_workers,
                    max_workers=component.max_workers,
                    hardware=list(component.hardware),
                    depends_on=list(component.depends_on),
                    initial_workers=component.gpus // (component.tp * component.pp),
                )
            JobTransition.objects.create(
                job=job, to_state=JobState.PENDING, reason=JobReason.SUBMITTED, actor=actor.label
            )
            audit.record(actor, "job.submit", job, job=job, payload={"name": job.name, "policy": job.policy})
    except IntegrityError:
        # A concurrent request with the same key won the race; answer with its job.
        existing = Job.objects.filter(owner=owner, idempotency_key=idempotency_key).first()
        if existing is None:
            raise
        if existing.idempotency_fingerprint != print_:
            raise IdempotencyConflict(idempotency_key) from None
        return Submission(existing, created=False)

    admit_pending(actor=Actor.scheduler())
    job.refresh_from_db()
    return Submission(job, created=True)


def _locked(job_id: int) -> Job:
    return Job.objects.select_for_update(no_key=True).get(pk=job_id)


def release_workers(job: Job, *, reason: str) -> None:
    """Stop a job's live workers. Devices whose workers never reached an agent are freed at once;
    the others are freed when their agent reports the workers stopped."""
    undelivered = agent_commands.cancel_undelivered(job.pk)
    live = list(Worker.objects.filter(group__job=job, state__in=LIVE_WORKER_STATES).select_related("group"))
    to_stop = []
    for worker in live:
        if worker.name in undelivered:
            worker.state = WorkerState.STOPPED
            worker.stopped_at = timezone.now()
            worker.save(update_fields=["state", "stopped_at"])
            release_devices(Device.objects.filter(worker=worker))
        else:
            worker.check_transition(WorkerState.STOPPING)
            worker.state = WorkerState.STOPPING
            worker.save(update_fields=["state"])
            to_stop.append(worker)
    if to_stop:
        agent_commands.queue_stop(to_stop, reason=reason)


def cancel_job(job_id: int, actor: Actor, detail: str = "") -> Job:
    with transaction.atomic():
        job = _locked(job_id)
        transition(job, JobState.CANCELLED, JobReason.CANCELLED_BY_OPERATOR, actor, detail)
        release_workers(job, reason="job cancelled")
    admit_pending(actor=Actor.scheduler())
    return job


def pause_scheduling(job_id: int, actor: Actor, detail: str = "") -> Job:
    with transaction.atomic():
        job = _locked(job_id)
        transition(job, JobState.PAUSED_SCHEDULING, JobReason.PAUSED_BY_OPERATOR, actor, detail)
    return job


def resume_scheduling(job_id: int, actor: Actor, detail: str = "") -> Job:
    with transaction.atomic():
        job = _locked(job_id)
        transition(job, JobState.RUNNING, JobReason.RESUMED_BY_OPERATOR, actor, detail)
    return job


def fail_job(job_id: int, reason: JobReason, actor: Actor, detail: str) -> bool:
    """Fail a running job for ``reason`` (e.g. a worker died) and stop its workers; False when it
    had already ended."""
    with transaction.atomic():
        job = _locked(job_id)
        if job.is_terminal:
            return False
        transition(job, JobState.FAILED, reason, actor, detail)
        release_workers(job, reason=f"job failed: {detail}")
    admit_pending(actor=Actor.scheduler())
    return True


def record_iteration_results(job_id: int, results: Sequence[Mapping[str, Any]], *, node: str) -> int:
    """Keep each iteration's result once (the first report of an iteration wins: every node of
    the job repeats the latest ones); returns how many were new."""
    rows = [
        IterationResult(
            job_id=job_id,
            iteration=int(result["iteration"]),
            mean_reward=float(result["mean_reward"]),
            metrics=dict(result),
            node=node,
        )
        for result in results
    ]
    known = set(
        IterationResult.objects.filter(job_id=job_id, iteration__in=[r.iteration for r in rows]).values_list(
            "iteration", flat=True
        )
    )
    fresh = [row for row in rows if row.iteration not in known]
    IterationResult.objects.bulk_create(fresh, ignore_conflicts=True)
    return len(fresh)
