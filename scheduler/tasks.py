"""Celery tasks of the scheduling loop. Thin: fetch by id, call a service."""

from __future__ import annotations

from celery import shared_task

from scheduler.services import tick


@shared_task(name="scheduler.tasks.schedule_ticks", ignore_result=True)
def schedule_ticks() -> int:
    """Beat fans out one tick task per due job; each runs wherever a worker is free."""
    due = tick.due_job_ids()
    for job_id in due:
        run_tick.apply_async(args=(job_id,), expires=5.0)
    return len(due)


@shared_task(name="scheduler.tasks.run_tick", ignore_result=True, acks_late=True)
def run_tick(job_id: int) -> None:
    tick.run_tick(job_id)
