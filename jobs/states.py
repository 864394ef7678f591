"""A job's state changes. Every one goes through ``transition`` under the job's row lock, writing
a JobTransition and an AuditEvent in the same transaction, so history can never disagree with the
current state."""

from __future__ import annotations

from django.utils import timezone

from common import audit
from common.audit import Actor
from jobs.models import Job, JobReason, JobState, JobTransition


def transition(job: Job, target: JobState, reason: JobReason, actor: Actor, detail: str = "") -> None:
    """Move a (row-locked) job to ``target``; raises IllegalTransition when not allowed."""
    job.check_transition(target)
    previous = job.state
    now = timezone.now()
    job.state = target
    job.state_reason = reason
    job.state_detail = detail
    if target == JobState.ADMITTED:
        job.admitted_at = now
    elif target == JobState.RUNNING and job.started_at is None:
        job.started_at = now
    elif job.is_terminal:
        job.finished_at = now
    job.save(
        update_fields=["state", "state_reason", "state_detail", "admitted_at", "started_at", "finished_at"]
    )
    JobTransition.objects.create(
        job=job, from_state=previous, to_state=target, reason=reason, detail=detail, actor=actor.label, at=now
    )
    audit.record(
        actor,
        f"job.{target}",
        job,
        job=job,
        reason=detail or reason,
        payload={"from": previous, "to": target},
    )
