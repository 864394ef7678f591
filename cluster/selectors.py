"""Read-side queries over the cluster's nodes and devices."""

from __future__ import annotations

from django.db.models import QuerySet

from cluster.models import FREE_DEVICE, Device, offering


def free_devices(backend: str | None = None) -> QuerySet[Device]:
    """Devices that may be handed out now (``FREE_DEVICE``), in placement order; only on nodes
    whose agent runs ``backend`` when one is named. Admission and the tick's free pool alike."""
    devices = Device.objects.filter(FREE_DEVICE)
    if backend is not None:
        devices = devices.filter(offering(backend, via="node__"))
    return devices.select_related("node").order_by("node__name", "index")
