"""Celery tasks of the agent side. Thin: each calls a service."""

from __future__ import annotations

from celery import shared_task

from agents.services import liveness
from scheduler import telemetry


@shared_task(name="agents.tasks.detect_lost_nodes", ignore_result=True)
def detect_lost_nodes() -> list[str]:
    return liveness.detect_lost_nodes()


@shared_task(name="agents.tasks.prune_telemetry", ignore_result=True)
def prune_telemetry() -> int:
    return telemetry.prune()
