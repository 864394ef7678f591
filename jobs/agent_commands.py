"""The commands that launch and stop a job's workers on their nodes: rows the agents fetch by long-poll."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from django.utils import timezone

from cluster.models import AgentCommand, CommandState, Device, Node
from jobs.models import Worker


def device_payload(device: Device, *, shared: bool) -> dict[str, Any]:
    """A worker's device in a command; ``shared``: time-shared with other workers of the job (a
    colocated placement), which the agent then lets them hold together and take turns on."""
    return {"uid": device.uid, "index": device.index, "hardware": device.hardware, "shared": shared}


def worker_payload(worker: Worker, devices: Iterable[Device], shared: set[str]) -> dict[str, Any]:
    """A worker as the agents see it: its job, group, kind, parallelism and devices (``shared``: the
    uids it time-shares with other workers of the job)."""
    group = worker.group
    return {
        "worker": worker.name,
        "job": group.job_id,
        "group": group.name,
        "kind": group.kind,
        "devices": [device_payload(d, shared=d.uid in shared) for d in devices],
        "tp": group.tp,
        "pp": group.pp,
    }


def queue_launch(
    workers_devices: Mapping[Worker, list[Device]], *, job_spec: Mapping[str, Any]
) -> list[AgentCommand]:
    """One ``launch_workers`` command per node, carrying the job's spec so the backend can run it.
    A device given to more than one of the workers is marked shared in each one's payload."""
    holders: dict[str, int] = defaultdict(int)
    for devices in workers_devices.values():
        for device in devices:
            holders[device.uid] += 1
    shared = {uid for uid, count in holders.items() if count > 1}
    per_node: dict[Node, list[dict[str, Any]]] = defaultdict(list)
    for worker, devices in workers_devices.items():
        per_node[devices[0].node].append(worker_payload(worker, devices, shared))
    commands = []
    for node, workers in per_node.items():
        first = workers[0]["worker"]
        commands.append(
            AgentCommand.objects.create(
                command_id=f"launch:{first}:{len(workers)}",
                node=node,
                kind="launch_workers",
                payload={"job": workers[0]["job"], "spec": dict(job_spec), "workers": workers},
            )
        )
    return commands


def queue_stop(
    workers: Iterable[Worker], *, reason: str, redo_from_iteration: int | None = None
) -> list[AgentCommand]:
    """One ``stop_workers`` command per node. ``redo_from_iteration``: the job is being placed anew
    and these are all its workers, so each node voids its progress from that iteration."""
    per_node: dict[Node, list[str]] = defaultdict(list)
    job_id = None
    for worker in workers:
        job_id = worker.group.job_id
        # A colocated worker may own no device: it runs where the devices it time-shares are.
        nodes = {d.node for d in [*worker.devices.all(), *worker.colocated_devices.all()]}
        for node in nodes:
            per_node[node].append(worker.name)
    return [
        AgentCommand.objects.create(
            command_id=f"stop:{names[0]}:{len(names)}:{timezone.now().timestamp():.6f}",
            node=node,
            kind="stop_workers",
            payload={"job": job_id, "workers": names, "reason": reason}
            | ({} if redo_from_iteration is None else {"redo_from_iteration": redo_from_iteration}),
        )
        for node, names in per_node.items()
    ]


def cancel_undelivered(job_id: int) -> set[str]:
    """Drop launch commands no agent has picked up yet; returns the names of their workers."""
    pending = AgentCommand.objects.select_for_update().filter(
        state=CommandState.QUEUED, kind="launch_workers", payload__job=job_id
    )
    names = {w["worker"] for command in pending for w in command.payload["workers"]}
    pending.update(state=CommandState.CANCELLED, finished_at=timezone.now())
    return names
