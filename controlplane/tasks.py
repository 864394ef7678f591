"""Celery tasks of the project itself. Tasks stay thin: they call a service."""

from celery import shared_task

from controlplane import health


@shared_task(name="controlplane.tasks.record_beat", ignore_result=True)
def record_beat() -> None:
    health.mark_beat()
