"""Celery tasks of the scheduling loop. Thin: fetch by id, call a service.

A tick that finds the database busy (no pooled connection in time, or the server at its
connection limit) is retried a few seconds later instead of failing; a fan-out that finds it busy
is skipped, as beat sends the next within a second (``common.dbbusy``).
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from common.dbbusy import retry_when_busy, skip_when_busy
from scheduler.services import tick


@shared_task(name="scheduler.tasks.schedule_ticks", ignore_result=True)
def schedule_ticks() -> int:
    """Beat fans out one tick task per due job; each runs wherever a worker is free."""
    due: list[int] = []
    with skip_when_busy("schedule_ticks"):
        due = tick.due_job_ids()
    for job_id in due:
        run_tick.apply_async(args=(job_id,), expires=5.0)
    return len(due)


@shared_task(name="scheduler.tasks.run_tick", bind=True, ignore_result=True, acks_late=True, max_retries=3)
def run_tick(self: Any, job_id: int) -> None:
    with retry_when_busy(self):
        tick.run_tick(job_id)
