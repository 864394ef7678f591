"""Building the core's Hypergraph from the database."""

from __future__ import annotations

from collections.abc import Mapping

from django.db.models import Prefetch

from cluster.models import Device
from jobs.models import LIVE_WORKER_STATES, Job, Worker, WorkerGroup
from scheduler.core.hypergraph import (
    ComponentKind,
    HyperEdge,
    Hypergraph,
    HyperNode,
    Interruptibility,
    Parallelism,
    Scaling,
)
from scheduler.core.hypergraph import (
    Device as CoreDevice,
)
from scheduler.core.hypergraph import (
    Worker as CoreWorker,
)
from scheduler.core.signals import GroupSignals


def core_device(device: Device) -> CoreDevice:
    return CoreDevice(
        id=device.uid,
        node=device.node.name,
        hardware=device.hardware,
        memory_gb=device.memory_gb,
        index=device.index,
    )


def live_groups(job: Job) -> list[WorkerGroup]:
    workers = Worker.objects.filter(state__in=LIVE_WORKER_STATES).prefetch_related(
        Prefetch("devices", queryset=Device.objects.select_related("node").order_by("node__name", "index")),
        Prefetch(
            "colocated_devices",
            queryset=Device.objects.select_related("node").order_by("node__name", "index"),
        ),
    )
    return list(job.groups.prefetch_related(Prefetch("workers", queryset=workers)).order_by("id"))


def build_hypergraph(
    job: Job, *, signals: Mapping[str, GroupSignals] | None = None, taken_at: float = 0.0
) -> Hypergraph:
    nodes = []
    for group in live_groups(job):
        workers = tuple(
            CoreWorker(
                id=w.name,
                devices=tuple(core_device(d) for d in [*w.devices.all(), *w.colocated_devices.all()]),
                utilisation=w.utilisation,
            )
            for w in group.workers.all()
        )
        nodes.append(
            HyperNode(
                id=group.name,
                kind=ComponentKind(group.kind),
                workers=workers,
                scaling=Scaling(group.scaling),
                depends_on=tuple(group.depends_on),
                interruptibility=Interruptibility(group.interruptibility),
                parallelism=Parallelism(tp=group.tp, pp=group.pp, valid_dp=tuple(group.valid_dp)),
                min_workers=group.min_workers,
                max_workers=group.max_workers,
                hardware_affinity=tuple(group.hardware),
            )
        )
    workload = job.spec.get("workload", {})
    items_total = int(workload.get("prompts_per_iteration", 0)) * int(workload.get("samples_per_prompt", 1))
    edges = []
    for node in nodes:
        for source in node.depends_on:
            produced = int(items_total * signals[source].progress) if signals and source in signals else 0
            consumed = int(items_total * signals[node.id].progress) if signals and node.id in signals else 0
            edges.append(
                HyperEdge(
                    id=f"{source}->{node.id}",
                    source=source,
                    target=node.id,
                    items_total=items_total,
                    items_produced=produced,
                    items_consumed=min(consumed, produced),
                )
            )
    return Hypergraph(
        job_id=str(job.pk),
        nodes=tuple(nodes),
        edges=tuple(edges),
        iteration=job.iteration,
        taken_at=taken_at,
    )
