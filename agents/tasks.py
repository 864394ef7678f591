"""Celery tasks of the agent side. Thin: each calls a service.

Importing ``agents.services`` here also connects its post_save receiver in every worker, so
commands the scheduling loop queues wake the nodes' long-polls at once.
"""

from __future__ import annotations

from celery import shared_task

from agents import services
from scheduler import telemetry


@shared_task(name="agents.tasks.detect_lost_nodes", ignore_result=True)
def detect_lost_nodes() -> list[str]:
    return services.detect_lost_nodes()


@shared_task(name="agents.tasks.prune_telemetry", ignore_result=True)
def prune_telemetry() -> int:
    return telemetry.prune()
