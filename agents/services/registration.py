"""Registration: a node's agent registers (or re-registers) with a bootstrap token, its devices are
created or brought up to date, its token is issued (rotated), commands its previous agent process
was given but never answered are queued again, and the reply tells it what it should be running.

Agents act as ``Actor.for_agent(node.name)``; the registration runs in one transaction with its
AuditEvents.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents.auth import issue_node_token
from agents.models import BootstrapToken
from agents.services.command_states import check_command
from agents.services.delivery import wake_node
from agents.services.liveness import restore_node
from agents.services.payloads import InvalidPayload, json_object, text_field
from cluster.models import AgentCommand, CommandState, Device, DeviceStatus, Node, NodeStatus
from common import audit
from common.audit import Actor
from jobs import agent_commands
from jobs.admission import admit_pending
from jobs.models import LIVE_WORKER_STATES, Job, Worker, WorkerGroup
from jobs.spec import BACKENDS as JOB_BACKENDS
from scheduler import telemetry
from scheduler.services.gpu_migrations import workers_released_in_flight, workers_switched_in_flight
from scheduler.telemetry import FieldError

HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


@dataclass(frozen=True)
class DeviceSpec:
    index: int
    hardware: str
    memory_gb: float


@dataclass(frozen=True)
class Registration:
    host: str
    backend: str
    backends: tuple[str, ...]  # the job backends the agent runs
    agent_version: str
    labels: dict[str, Any]
    devices: tuple[DeviceSpec, ...]
    steps_outlive_agent: bool = False


def parse_registration(payload: Any) -> Registration:
    data = json_object(payload)
    errors: list[FieldError] = []
    host = text_field(data, "host", errors, max_length=200)
    if host and not HOST_NAME.match(host):
        errors.append(
            FieldError("host", "letters, digits, '.', '_' and '-' only, starting with a letter or digit")
        )
    backends = _backends(data, errors)
    backend = text_field(data, "backend", errors, max_length=16, default=backends[0] if backends else "sim")
    if backend not in JOB_BACKENDS:
        errors.append(FieldError("backend", f"must be {_either(JOB_BACKENDS)}"))
    elif backends and backend not in backends:
        errors.append(FieldError("backends", f"must include the agent's backend {backend!r}"))
    agent_version = text_field(data, "agent_version", errors, max_length=32, default="")
    steps_outlive_agent = data.get("steps_outlive_agent", False)
    if not isinstance(steps_outlive_agent, bool):
        errors.append(FieldError("steps_outlive_agent", "must be true or false"))
        steps_outlive_agent = False
    labels = data.get("labels", {})
    if not isinstance(labels, Mapping):
        errors.append(FieldError("labels", "must be an object"))
        labels = {}
    raw_devices = data.get("devices")
    devices: list[DeviceSpec] = []
    if not isinstance(raw_devices, list):
        errors.append(FieldError("devices", "must be a list (empty for a host without accelerators)"))
        raw_devices = []
    seen: set[int] = set()
    for i, item in enumerate(raw_devices):
        path = f"devices[{i}]"
        if not isinstance(item, Mapping):
            errors.append(FieldError(path, "must be an object"))
            continue
        index = item.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            errors.append(FieldError(f"{path}.index", "must be an integer, at least 0"))
            continue
        if index in seen:
            errors.append(FieldError(f"{path}.index", f"device {index} is listed twice"))
        seen.add(index)
        hardware = item.get("hardware")
        if not isinstance(hardware, str) or not hardware or len(hardware) > 32:
            errors.append(
                FieldError(f"{path}.hardware", "must be a non-empty string of at most 32 characters")
            )
            hardware = ""
        memory = item.get("memory_gb")
        if isinstance(memory, bool) or not isinstance(memory, int | float) or not memory > 0:
            errors.append(FieldError(f"{path}.memory_gb", "must be a number above 0"))
            memory = 0.0
        devices.append(DeviceSpec(index=index, hardware=hardware, memory_gb=float(memory)))
    if errors:
        raise InvalidPayload(errors)
    return Registration(
        host=host,
        backend=backend,
        backends=backends or (backend,),
        agent_version=agent_version,
        labels=dict(labels),
        devices=tuple(devices),
        steps_outlive_agent=steps_outlive_agent,
    )


def _either(names: Iterable[str]) -> str:
    return " or ".join(repr(n) for n in names)


def _backends(data: Mapping[str, Any], errors: list[FieldError]) -> tuple[str, ...]:
    """The optional ``backends`` list; empty when absent (an older agent: its ``backend`` alone)."""
    raw = data.get("backends")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        errors.append(FieldError("backends", "must be a non-empty list of backend names"))
        return ()
    found: list[str] = []
    for i, name in enumerate(raw):
        if not isinstance(name, str) or name not in JOB_BACKENDS:
            errors.append(FieldError(f"backends[{i}]", f"must be {_either(JOB_BACKENDS)}"))
        elif name in found:
            errors.append(FieldError(f"backends[{i}]", f"{name!r} is listed twice"))
        else:
            found.append(name)
    return tuple(found)


@dataclass
class RegisterOutcome:
    node: Node
    token: str
    created: bool
    devices: list[Device]
    workers: list[dict[str, Any]]
    jobs: dict[str, Any]


def register(bootstrap: BootstrapToken, payload: Any) -> RegisterOutcome:
    """Create or re-attach the node named ``host`` and its devices, and issue (rotate) its token.

    A re-registering node keeps its devices' owners: its workers are not orphaned. Commands it had
    been given but not answered are queued again for the new agent process.
    """
    spec = parse_registration(payload)
    actor = Actor.for_agent(spec.host)
    now = timezone.now()
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=spec.host).first()
        created = node is None
        previous_status = ""
        previous_backends: list[str] | None = None
        if node is None:
            node = Node.objects.create(
                name=spec.host,
                backend=spec.backend,
                backends=list(spec.backends),
                agent_version=spec.agent_version,
                steps_outlive_agent=spec.steps_outlive_agent,
                labels=spec.labels,
                registered_at=now,
                last_heartbeat_at=now,
                status=NodeStatus.READY,
                status_reason="registered",
            )
        else:
            previous_status = node.status
            previous_backends = list(node.backends)
            node.backend = spec.backend
            node.backends = list(spec.backends)
            node.agent_version = spec.agent_version
            node.steps_outlive_agent = spec.steps_outlive_agent
            node.labels = spec.labels
            node.registered_at = now
            node.last_heartbeat_at = now
            node.save(
                update_fields=[
                    "backend",
                    "backends",
                    "agent_version",
                    "steps_outlive_agent",
                    "labels",
                    "registered_at",
                    "last_heartbeat_at",
                ]
            )
            if node.status == NodeStatus.LOST:
                restore_node(node, actor, why="registered again")
        added, missing = _sync_devices(node, spec.devices, actor)
        token = issue_node_token(node)
        requeued = _requeue_unanswered(node, actor)
        audit.record(
            actor,
            "node.register" if created else "node.reregister",
            node,
            reason="bootstrap token " + bootstrap.name,
            payload={
                "devices": len(spec.devices),
                "devices_added": added,
                "devices_missing": missing,
                "previous_status": previous_status,
                "token_rotated": not created,
                "commands_requeued": requeued,
                "agent_version": spec.agent_version,
                "backends": list(spec.backends),
                "steps_outlive_agent": spec.steps_outlive_agent,
            },
        )
        if previous_backends is not None and previous_backends != node.backends:
            # From now on admission places jobs here by the new list; workers already here stay.
            audit.record(
                actor,
                "node.backends_changed",
                node,
                reason=f"backends {', '.join(previous_backends)} -> {', '.join(node.backends)}",
                payload={"from": previous_backends, "to": node.backends},
            )
        devices = list(Device.objects.filter(node=node).order_by("index"))
        workers, jobs = expected_workers(node)
        node_id = node.pk
        transaction.on_commit(lambda: telemetry.forget_node(node_id))
        if requeued:
            transaction.on_commit(lambda: wake_node(node_id))
    admit_pending(actor=actor)
    return RegisterOutcome(
        node=node, token=token, created=created, devices=devices, workers=workers, jobs=jobs
    )


def _sync_devices(node: Node, reported: Iterable[DeviceSpec], actor: Actor) -> tuple[list[str], list[str]]:
    """Create new devices, refresh known ones, mark unreported ones lost. Owners never change here."""
    existing = {d.index: d for d in Device.objects.select_for_update().filter(node=node)}
    added: list[str] = []
    seen: set[int] = set()
    for spec in reported:
        seen.add(spec.index)
        device = existing.get(spec.index)
        if device is None:
            device = Device.objects.create(
                node=node,
                index=spec.index,
                uid=f"{node.name}/gpu{spec.index}",
                hardware=spec.hardware,
                memory_gb=spec.memory_gb,
            )
            added.append(device.uid)
            continue
        status = _status_by_owner(device) if device.status == DeviceStatus.LOST else device.status
        if (device.hardware, device.memory_gb, device.status) != (spec.hardware, spec.memory_gb, status):
            device.hardware, device.memory_gb, device.status = spec.hardware, spec.memory_gb, status
            device.save(update_fields=["hardware", "memory_gb", "status"])
    missing = [d for index, d in existing.items() if index not in seen]
    for device in missing:
        if device.status != DeviceStatus.LOST:
            device.status = DeviceStatus.LOST
            device.save(update_fields=["status"])
        if device.worker_id is not None:
            # An owned device keeps its owner; the group is flagged so an operator sees its worker
            # lost a GPU.
            WorkerGroup.objects.filter(workers__pk=device.worker_id).update(
                flagged=True, flag_reason=f"device {device.uid} missing from {node.name}'s registration"
            )
    if missing:
        audit.record(actor, "node.devices_missing", node, payload={"devices": [d.uid for d in missing]})
    return added, [d.uid for d in missing]


def _status_by_owner(device: Device) -> str:
    return DeviceStatus.ALLOCATED if device.worker_id is not None else DeviceStatus.FREE


def _requeue_unanswered(node: Node, actor: Actor) -> int:
    """A new agent process never saw what the old one was given: deliver it again at once."""
    unanswered = list(
        AgentCommand.objects.select_for_update().filter(node=node, state=CommandState.DELIVERED)
    )
    for command in unanswered:
        check_command(command, CommandState.QUEUED)
    AgentCommand.objects.filter(pk__in=[c.pk for c in unanswered]).update(state=CommandState.QUEUED)
    if unanswered:
        audit.record(
            actor, "agent.commands.requeue", node, payload={"commands": [c.command_id for c in unanswered]}
        )
    return len(unanswered)


def _worker_json(worker: Worker, devices: Iterable[Device], shared: set[int]) -> dict[str, Any]:
    devices = list(devices)
    payload = agent_commands.worker_payload(worker, devices, {d.uid for d in devices if d.pk in shared})
    return {**payload, "state": worker.state}


def expected_workers(node: Node) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The workers this node should be running (starting or running, on its devices), and the
    specs of their jobs: what a restarted agent reconciles against. Workers an open migration has
    already released are not among them; new workers of one past its switch are."""
    workers = (
        Worker.objects.filter(state__in=LIVE_WORKER_STATES)
        .exclude(name__in=workers_released_in_flight())
        .filter(Q(devices__node=node) | Q(colocated_devices__node=node))
        .distinct()
        .select_related("group", "group__job")
        .prefetch_related("devices", "colocated_devices")
        .order_by("name")
    )
    result = []
    jobs: dict[str, Any] = {}
    # A colocated worker's devices are time-shared, for it and for their owner (all live here).
    shared = {d.pk for worker in workers for d in worker.colocated_devices.all()}
    for worker in workers:
        devices = [
            d
            for d in sorted([*worker.devices.all(), *worker.colocated_devices.all()], key=lambda d: d.index)
            if d.node_id == node.pk
        ]
        result.append(_worker_json(worker, devices, shared))
        jobs[str(worker.group.job_id)] = worker.group.job.spec
    for switched in workers_switched_in_flight(node):
        result.append(switched)
        jobs.setdefault(str(switched["job"]), Job.objects.get(pk=switched["job"]).spec)
    return result, jobs
