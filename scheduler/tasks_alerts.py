"""Celery beat tasks of the monitor. Thin: each calls a service.

Not named ``tasks.py``, so settings list it in ``CELERY_IMPORTS`` for the workers to register.
"""

from __future__ import annotations

from celery import shared_task

from scheduler import alerts
from scheduler.services import rollups


@shared_task(name="scheduler.tasks_alerts.detect_anomalies", ignore_result=True)
def detect_anomalies() -> dict[str, int]:
    result = alerts.run_detection()
    return {"raised": len(result.raised), "cleared": len(result.cleared), "open": result.open}


@shared_task(name="scheduler.tasks_alerts.publish_telemetry_rollups", ignore_result=True)
def publish_telemetry_rollups() -> int:
    return rollups.publish_telemetry_rollups()
