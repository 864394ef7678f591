"""Read-side queries over the cluster's nodes and devices."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import QuerySet

from cluster.models import FREE_DEVICE, AgentCommand, CommandState, Device, offering


def free_devices(backend: str | None = None) -> QuerySet[Device]:
    """Devices that may be handed out now (``FREE_DEVICE``), in placement order; only on nodes
    whose agent runs ``backend`` when one is named. Admission and the tick's free pool alike."""
    devices = Device.objects.filter(FREE_DEVICE)
    if backend is not None:
        devices = devices.filter(offering(backend, via="node__"))
    return devices.select_related("node").order_by("node__name", "index")


def stop_reports(job_id: int, *, redo_from_iteration: int, since: datetime) -> dict[str, dict[str, Any]]:
    """What each node's agent reported when it stopped a job's workers to place it anew (since
    ``since``), by node: its backend's detail (on Ray, whether the trainer's state was kept)."""
    stops = AgentCommand.objects.filter(
        kind="stop_workers",
        state__in=(CommandState.DONE, CommandState.FAILED),
        payload__job=job_id,
        payload__redo_from_iteration=redo_from_iteration,
        created_at__gte=since,
    ).select_related("node")
    return {
        stop.node.name: dict(result) if isinstance(result := stop.result.get("result"), dict) else {}
        for stop in stops.order_by("node__name")
    }
