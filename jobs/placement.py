"""What a job asks of the cluster, and where it could run: its groups as placement requests, the
devices of the nodes running its backend, and whether it could ever fit."""

from __future__ import annotations

from collections.abc import Iterable

from cluster.models import Device
from jobs.spec import JobSpec
from scheduler.core.hypergraph import Device as CoreDevice
from scheduler.core.placement import GroupRequest, PlacementFailure, fits_in


def group_requests(spec: JobSpec) -> list[GroupRequest]:
    return [
        GroupRequest(
            name=c.name,
            workers=c.workers if c.workers is not None else 0,
            gpus_per_worker=c.tp * c.pp,
            hardware=tuple(c.hardware),
            ranks=tuple(c.placement) if c.placement is not None else None,
        )
        for c in spec.components
    ]


def core_devices(devices: list[Device]) -> list[CoreDevice]:
    return [
        CoreDevice(id=d.uid, node=d.node.name, hardware=d.hardware, memory_gb=d.memory_gb, index=d.index)
        for d in devices
    ]


def registered_devices() -> list[Device]:
    """Every device of every registered node, whatever its state: the cluster explicit ranks count
    over (a lost or drained node keeps its place, so ranks never shift) and whose shape decides
    whether a job could ever run."""
    return list(Device.objects.select_related("node"))


def backend_devices(devices: Iterable[Device], backend: str) -> list[Device]:
    """The devices of nodes whose agent runs jobs of ``backend``: the only ones such a job may use."""
    return [d for d in devices if d.node.offers(backend)]


def never_fits(requests: list[GroupRequest], devices: list[Device], backend: str) -> PlacementFailure | None:
    """Why a job of ``backend`` could never run on ``devices`` (registered ones), or None.

    It could never run when it fits neither on the nodes that run its backend nor on the cluster
    as a whole: more nodes of its backend may register (a ray job waits for ray nodes), but a job
    that no cluster of this shape could hold is refused at once.
    """
    pool = backend_devices(devices, backend)
    on_pool = fits_in(requests, core_devices(pool))
    if on_pool is None:
        return None
    on_cluster = fits_in(requests, core_devices(devices)) if len(pool) < len(devices) else on_pool
    if on_cluster is None:
        return None
    return on_pool if pool else on_cluster
