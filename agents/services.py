"""The agent protocol's business logic: registration, heartbeats, command delivery and reports,
and node liveness.

Every state change here runs in one transaction with its AuditEvent (agents act as
``Actor.for_agent(node.name)``; the liveness check as ``Actor.system("liveness")``). Commands move
through ``COMMAND_TRANSITIONS``; a report for a finished command changes nothing and answers with
the recorded outcome. Lock order, the same as the rest of the control plane: job, then command,
then workers and devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.utils import timezone

from agents import commands
from agents.auth import issue_node_token
from agents.models import (
    AgentCommand,
    BootstrapToken,
    CommandState,
    Device,
    DeviceStatus,
    Node,
    NodeStatus,
    release_devices,
)
from controlplane import audit
from controlplane.audit import Actor
from controlplane.models import AuditEvent
from controlplane.transitions import check_transition
from jobs import services as job_services
from jobs.models import LIVE_WORKER_STATES, Job, JobReason, JobState, Worker, WorkerGroup, WorkerState
from jobs.spec import BACKENDS as JOB_BACKENDS
from scheduler import progress, telemetry
from scheduler.services.migrations import workers_released_in_flight, workers_switched_in_flight
from scheduler.telemetry import FieldError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_WAIT_S = 25.0
MAX_WAIT_S = 60.0
MAX_COMMANDS_PER_FETCH = 50
WAIT_JITTER = 0.2  # an empty long-poll answers after wait x U(0.8, 1)
WAKE_CHANNEL = "dynarl:agent:wake"
NODE_LOST_FLAG_PREFIX = "node lost: "  # WorkerGroup.flag_reason of groups flagged by a lost node
LIVENESS_ACTOR = Actor.system("liveness")

COMMAND_TRANSITIONS: dict[str, frozenset[str]] = {
    CommandState.QUEUED: frozenset(
        {CommandState.DELIVERED, CommandState.DONE, CommandState.FAILED, CommandState.CANCELLED}
    ),
    # DELIVERED -> DELIVERED is a re-delivery; -> QUEUED when the node's agent registers again.
    CommandState.DELIVERED: frozenset(
        {
            CommandState.DELIVERED,
            CommandState.QUEUED,
            CommandState.DONE,
            CommandState.FAILED,
            CommandState.CANCELLED,
        }
    ),
    CommandState.DONE: frozenset(),
    CommandState.FAILED: frozenset(),
    CommandState.CANCELLED: frozenset(),
}
FINISHED_COMMAND_STATES = frozenset({CommandState.DONE, CommandState.FAILED, CommandState.CANCELLED})
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class InvalidPayload(ValueError):
    """A request body the protocol cannot accept; ``errors`` names every field at fault."""

    def __init__(self, errors: Iterable[FieldError]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{e.path}: {e.message}" for e in self.errors))


class CommandNotFound(Exception):
    pass


class NotYourCommand(Exception):
    """A node reported (or asked about) a command queued for another node."""


def _check_command(command: AgentCommand, target: str) -> None:
    check_transition("agent command", COMMAND_TRANSITIONS, command.state, target)


# --- payload checks --------------------------------------------------------------------------------


def _object(payload: Any) -> Mapping[str, Any]:
    if not isinstance(payload, Mapping):
        raise InvalidPayload([FieldError("", "must be a JSON object")])
    return payload


def _text(
    data: Mapping[str, Any],
    key: str,
    errors: list[FieldError],
    *,
    max_length: int,
    default: str | None = None,
) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        errors.append(
            FieldError(key, "must be a non-empty string" if default is None else "must be a string")
        )
        return ""
    if len(value) > max_length:
        errors.append(FieldError(key, f"must be at most {max_length} characters"))
    return value


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


def parse_registration(payload: Any) -> Registration:
    data = _object(payload)
    errors: list[FieldError] = []
    host = _text(data, "host", errors, max_length=200)
    if host and not HOST_NAME.match(host):
        errors.append(
            FieldError("host", "letters, digits, '.', '_' and '-' only, starting with a letter or digit")
        )
    backends = _backends(data, errors)
    backend = _text(data, "backend", errors, max_length=16, default=backends[0] if backends else "sim")
    if backend not in JOB_BACKENDS:
        errors.append(FieldError("backend", f"must be {_either(JOB_BACKENDS)}"))
    elif backends and backend not in backends:
        errors.append(FieldError("backends", f"must include the agent's backend {backend!r}"))
    agent_version = _text(data, "agent_version", errors, max_length=32, default="")
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


@dataclass(frozen=True)
class Report:
    ok: bool
    error: str
    result: dict[str, Any]
    workers: dict[str, dict[str, Any]]  # per-worker outcome of launch/stop commands, when given


def parse_report(payload: Any) -> Report:
    data = _object(payload)
    errors: list[FieldError] = []
    ok = data.get("ok")
    if not isinstance(ok, bool):
        errors.append(FieldError("ok", "must be true or false"))
    error = _text(data, "error", errors, max_length=10_000, default="")
    result = data.get("result", {})
    if not isinstance(result, Mapping):
        errors.append(FieldError("result", "must be an object"))
        result = {}
    workers: dict[str, dict[str, Any]] = {}
    raw_workers = data.get("workers", {})
    if not isinstance(raw_workers, Mapping):
        errors.append(FieldError("workers", "must be an object mapping worker names to outcomes"))
        raw_workers = {}
    for name, outcome in raw_workers.items():
        path = f"workers.{name}"
        if not isinstance(outcome, Mapping) or not isinstance(outcome.get("ok"), bool):
            errors.append(FieldError(f"{path}.ok", "must be true or false"))
            continue
        detail = outcome.get("error", "")
        if not isinstance(detail, str):
            errors.append(FieldError(f"{path}.error", "must be a string"))
            detail = ""
        workers[name] = {"ok": outcome["ok"], "error": detail}
    if errors:
        raise InvalidPayload(errors)
    return Report(ok=bool(ok), error=error, result=dict(result), workers=workers)


# --- wake-ups for long-polls -------------------------------------------------------------------------
#
# A command's creation publishes the node's id on one Redis channel. Each server process holds one
# subscription and fans the message out to the long-polls of that node waiting in the process, so
# a thousand waiting agents cost one Redis connection, not a thousand. Wake-ups are best effort:
# a poll also rechecks the database every AGENT_POLL_FALLBACK_S.


def wake_node(node_id: int) -> None:
    """Tell the node's waiting long-polls that a command is queued. Never fails the caller."""
    try:
        telemetry.redis_client().publish(WAKE_CHANNEL, str(node_id))
    except redis.RedisError:
        log.warning("could not wake node %s; its long-poll will find the command by polling", node_id)


@receiver(post_save, sender=AgentCommand, dispatch_uid="agents.services.wake_on_command")
def _wake_on_command(
    sender: type[AgentCommand], instance: AgentCommand, created: bool, **kwargs: Any
) -> None:
    if created:
        node_id = instance.node_id
        transaction.on_commit(lambda: wake_node(node_id))


class WakeListener:
    """The process's subscription to wake-ups (one per event loop), reconnecting when Redis drops."""

    def __init__(self) -> None:
        self.waiters: dict[int, set[asyncio.Event]] = {}
        self.subscribed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def watch(self, node_id: int) -> asyncio.Event:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._listen())
        event = asyncio.Event()
        self.waiters.setdefault(node_id, set()).add(event)
        return event

    def unwatch(self, node_id: int, event: asyncio.Event) -> None:
        events = self.waiters.get(node_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self.waiters[node_id]

    async def _listen(self) -> None:
        while True:
            client = aioredis.Redis.from_url(
                settings.REDIS_URL, socket_timeout=None, health_check_interval=30
            )
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(WAKE_CHANNEL)
                    self.subscribed.set()
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            for event in self.waiters.get(int(message["data"]), ()):
                                event.set()
            except (redis.RedisError, OSError):
                log.warning(
                    "lost the Redis wake-up subscription; long-polls fall back to polling", exc_info=True
                )
            finally:
                self.subscribed.clear()
                await client.aclose()
            # Wake everyone to recheck the database, then retry the subscription.
            for events in self.waiters.values():
                for event in events:
                    event.set()
            await asyncio.sleep(1.0)


_listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WakeListener] = weakref.WeakKeyDictionary()


def wake_listener() -> WakeListener:
    loop = asyncio.get_running_loop()
    listener = _listeners.get(loop)
    if listener is None:
        listener = _listeners[loop] = WakeListener()
    return listener


# --- registration ----------------------------------------------------------------------------------


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
            node.labels = spec.labels
            node.registered_at = now
            node.last_heartbeat_at = now
            node.save(
                update_fields=[
                    "backend",
                    "backends",
                    "agent_version",
                    "labels",
                    "registered_at",
                    "last_heartbeat_at",
                ]
            )
            if node.status == NodeStatus.LOST:
                _restore_node(node, actor, why="registered again")
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
    _admit_waiting(actor)
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
        _check_command(command, CommandState.QUEUED)
    AgentCommand.objects.filter(pk__in=[c.pk for c in unanswered]).update(state=CommandState.QUEUED)
    if unanswered:
        audit.record(
            actor, "agent.commands.requeue", node, payload={"commands": [c.command_id for c in unanswered]}
        )
    return len(unanswered)


def _worker_json(worker: Worker, devices: Iterable[Device], shared: set[int]) -> dict[str, Any]:
    group = worker.group
    return {
        "worker": worker.name,
        "job": group.job_id,
        "group": group.name,
        "kind": group.kind,
        "state": worker.state,
        "devices": [commands.device_payload(d, shared=d.pk in shared) for d in devices],
        "tp": group.tp,
        "pp": group.pp,
    }


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


def _admit_waiting(actor: Actor) -> None:
    from jobs.admission import admit_pending

    admit_pending(actor=actor)


# --- heartbeats and liveness -----------------------------------------------------------------------


@dataclass
class HeartbeatOutcome:
    node_status: str
    ingest: telemetry.IngestResult
    recovered: bool = False
    server_time: float = field(default_factory=time.time)


def heartbeat(node: Node, payload: Any, *, now: float | None = None) -> HeartbeatOutcome:
    """Record that the node is alive and ingest its telemetry. A lost node comes back here.

    Liveness and telemetry are independent writes: each is one statement, so the common case
    takes no explicit transaction."""
    now = time.time() if now is None else now
    beat = telemetry.parse_heartbeat(payload, now)  # a bad body is refused before anything is written
    jobs_progress = payload.get("jobs", []) if isinstance(payload, Mapping) else []
    progress.record(node, jobs_progress, now=now)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {connection.ops.quote_name(Node._meta.db_table)} SET last_heartbeat_at = %s "
            "WHERE id = %s RETURNING status",
            [datetime.fromtimestamp(now, tz=UTC), node.pk],
        )
        row = cursor.fetchone()
    status = row[0] if row else node.status
    recovered = status == NodeStatus.LOST
    if recovered:
        actor = Actor.for_agent(node.name)
        with transaction.atomic():
            node = Node.objects.select_for_update().get(pk=node.pk)
            status = (
                _restore_node(node, actor, why="heartbeat resumed")
                if node.status == NodeStatus.LOST
                else node.status
            )
        _admit_waiting(actor)
    result = telemetry.ingest_heartbeat(node, beat, now=now)
    return HeartbeatOutcome(node_status=status, ingest=result, recovered=recovered, server_time=now)


def _restore_node(node: Node, actor: Actor, *, why: str) -> str:
    """A lost node is back: ready (or drained, if it was), devices free or allocated as their owner
    says, and its groups' node-lost flags cleared. The caller holds the node's row lock."""
    lost_event = (
        AuditEvent.objects.filter(
            verb="node.lost", object_type=Node._meta.label_lower, object_id=str(node.pk)
        )
        .order_by("-at", "-id")
        .first()
    )
    was_drained = bool(lost_event and lost_event.payload.get("previous_status") == NodeStatus.DRAINED)
    node.status = NodeStatus.DRAINED if was_drained else NodeStatus.READY
    node.status_reason = why
    node.save(update_fields=["status", "status_reason"])
    Device.objects.filter(node=node, status=DeviceStatus.LOST, worker__isnull=True).update(
        status=DeviceStatus.FREE
    )
    Device.objects.filter(node=node, status=DeviceStatus.LOST, worker__isnull=False).update(
        status=DeviceStatus.ALLOCATED
    )
    cleared = _clear_lost_flags(node)
    audit.record(
        actor, "node.recover", node, reason=why, payload={"status": node.status, "groups_unflagged": cleared}
    )
    return node.status


def _clear_lost_flags(node: Node) -> list[int]:
    """Unflag groups flagged for this node's loss that have no worker on another lost node."""
    flagged = WorkerGroup.objects.filter(
        flagged=True, flag_reason__startswith=f"{NODE_LOST_FLAG_PREFIX}{node.name}:"
    )
    cleared = []
    for group in flagged:
        still_lost = (
            Device.objects.filter(node__status=NodeStatus.LOST)
            .exclude(node=node)
            .filter(Q(worker__group=group) | Q(colocated_workers__group=group))
            .exists()
        )
        if not still_lost:
            group.flagged, group.flag_reason = False, ""
            group.save(update_fields=["flagged", "flag_reason"])
            cleared.append(group.pk)
    return cleared


def detect_lost_nodes(now: datetime | None = None) -> list[str]:
    """Mark nodes silent for NODE_LOST_AFTER_S as lost and roll back the migrations they were in."""
    from scheduler.services import migrations

    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.NODE_LOST_AFTER_S)
    silent = Node.objects.exclude(status=NodeStatus.LOST).filter(
        Q(last_heartbeat_at__lt=cutoff) | Q(last_heartbeat_at__isnull=True, registered_at__lt=cutoff)
    )
    lost = []
    for node_id in silent.values_list("pk", flat=True):
        node = mark_node_lost(node_id, cutoff=cutoff, now=now)
        if node is not None:
            migrations.roll_back_node(node, LIVENESS_ACTOR)
            lost.append(node.name)
    return lost


def mark_node_lost(node_id: int, *, cutoff: datetime, now: datetime) -> Node | None:
    """Lost: the node, its free devices, and a flag on each group with a worker there. None when the
    node heartbeated meanwhile (or another checker holds it)."""
    with transaction.atomic():
        node = (
            Node.objects.select_for_update(skip_locked=True)
            .filter(pk=node_id)
            .exclude(status=NodeStatus.LOST)
            .first()
        )
        if node is None:
            return None
        last = node.last_heartbeat_at or node.registered_at
        if last >= cutoff:
            return None
        silent_s = (now - last).total_seconds()
        previous = node.status
        node.status = NodeStatus.LOST
        node.status_reason = f"no heartbeat for {silent_s:.0f}s (last at {last.isoformat()})"
        node.save(update_fields=["status", "status_reason"])
        # Every device of the node is lost; owned ones keep their owner for when the node comes back
        # (allocated again then), and the flag tells the job.
        lost_devices = Device.objects.filter(node=node).update(status=DeviceStatus.LOST)
        reason = f"{NODE_LOST_FLAG_PREFIX}{node.name}: {node.status_reason}"
        groups = list(
            WorkerGroup.objects.filter(
                Q(workers__devices__node=node) | Q(workers__colocated_devices__node=node),
                workers__state__in=(*LIVE_WORKER_STATES, WorkerState.STOPPING),
            )
            .distinct()
            .select_related("job")
        )
        for group in groups:
            group.flagged, group.flag_reason = True, reason
            group.save(update_fields=["flagged", "flag_reason"])
            audit.record(LIVENESS_ACTOR, "group.flag", group, job=group.job, reason=reason)
        audit.record(
            LIVENESS_ACTOR,
            "node.lost",
            node,
            reason=node.status_reason,
            payload={
                "previous_status": previous,
                "devices_lost": lost_devices,
                "groups_flagged": [f"{g.job_id}/{g.name}" for g in groups],
            },
        )
        return node


# --- commands: delivery ------------------------------------------------------------------------------


def command_json(command: AgentCommand) -> dict[str, Any]:
    return {
        "command_id": command.command_id,
        "kind": command.kind,
        "payload": command.payload,
        "deliveries": command.deliveries,
        "created_at": command.created_at.isoformat(),
    }


def _obsolete(command: AgentCommand) -> str:
    """Why a command no longer needs doing ("" when it still does)."""
    if command.kind == "migration_step":
        step = command.step
        if step is None:
            return "its migration step no longer exists"
        if step.state != "running" or command.payload.get("attempt") != step.attempts:
            return f"its migration step is {step.state} (attempt {step.attempts})"
        return ""
    names = [w["worker"] if isinstance(w, Mapping) else w for w in command.payload.get("workers", [])]
    wanted = {
        "launch_workers": (WorkerState.STARTING,),
        "stop_workers": (*LIVE_WORKER_STATES, WorkerState.STOPPING),
    }
    states = wanted.get(command.kind)
    if states and names and not Worker.objects.filter(name__in=names, state__in=states).exists():
        return "none of its workers needs it any more"
    return ""


def claim_commands(node: Node, *, limit: int = MAX_COMMANDS_PER_FETCH) -> list[AgentCommand]:
    """Hand the node its queued commands, and again those delivered but unanswered for
    AGENT_COMMAND_REDELIVER_S; commands that no longer need doing are cancelled instead."""
    actor = Actor.for_agent(node.name)
    now = timezone.now()
    stale = now - timedelta(seconds=settings.AGENT_COMMAND_REDELIVER_S)
    with transaction.atomic():
        due = list(
            AgentCommand.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(node=node)
            .filter(Q(state=CommandState.QUEUED) | Q(state=CommandState.DELIVERED, delivered_at__lt=stale))
            .select_related("step")
            .order_by("created_at", "id")[:limit]
        )
        if not due:
            return []
        jobs = Job.objects.in_bulk(
            {c.payload.get("job") for c in due if isinstance(c.payload.get("job"), int)}
        )
        delivered = []
        for command in due:
            job = jobs.get(command.payload.get("job"))
            why = _obsolete(command)
            if why:
                _check_command(command, CommandState.CANCELLED)
                command.state = CommandState.CANCELLED
                command.finished_at = now
                command.result = {"cancelled": why}
                command.save(update_fields=["state", "finished_at", "result"])
                audit.record(actor, "agent.command.cancel", command, job=job, reason=why)
                continue
            _check_command(command, CommandState.DELIVERED)
            redelivery = command.state == CommandState.DELIVERED
            command.state = CommandState.DELIVERED
            command.delivered_at = now
            command.deliveries += 1  # the row is locked: no concurrent delivery can be lost
            command.save(update_fields=["state", "delivered_at", "deliveries"])
            audit.record(
                actor,
                "agent.command.redeliver" if redelivery else "agent.command.deliver",
                command,
                job=job,
                payload={"kind": command.kind, "deliveries": command.deliveries},
            )
            delivered.append(command)
        return delivered


async def wait_for_commands(
    node: Node, wait_s: float, *, run: Callable[..., Awaitable[Any]] | None = None
) -> list[AgentCommand]:
    """Long-poll: the node's commands as soon as there are any, or [] after ``wait_s``.

    ``run`` runs the blocking claim (default: Django's thread-sensitive sync_to_async).
    """
    loop = asyncio.get_running_loop()
    # Empty answers come back spread over the last fifth of the wait: agents that started polling
    # together (a restart, a network blip) do not stay in lockstep and re-poll all at once.
    deadline = loop.time() + wait_s * random.uniform(1 - WAIT_JITTER, 1.0)
    runner = run or (lambda func, *args: sync_to_async(func)(*args))
    commands: list[AgentCommand] = await runner(claim_commands, node)
    if commands or wait_s <= 0:
        return commands
    listener = wake_listener()
    # Watch before each claim: a command committed after the claim always wakes this poll.
    woken = listener.watch(node.pk)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(listener.subscribed.wait(), timeout=min(1.0, wait_s))
        while True:
            commands = await runner(claim_commands, node)
            remaining = deadline - loop.time()
            if commands or remaining <= 0:
                return commands
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), timeout=min(remaining, settings.AGENT_POLL_FALLBACK_S))
            woken.clear()
    finally:
        listener.unwatch(node.pk, woken)


# --- commands: reports -----------------------------------------------------------------------------


@dataclass
class ReportOutcome:
    command: AgentCommand
    repeated: bool


def report_command(node: Node, command_id: str, payload: Any) -> ReportOutcome:
    """An agent's outcome of one command. Idempotent: a command already finished keeps its
    recorded outcome and the report changes nothing."""
    report = parse_report(payload)
    command = AgentCommand.objects.filter(command_id=command_id).first()
    if command is None:
        raise CommandNotFound(command_id)
    if command.node_id != node.pk:
        raise NotYourCommand(f"command {command_id} is not for node {node.name}")
    if command.state in FINISHED_COMMAND_STATES:
        return ReportOutcome(command, repeated=True)
    if command.kind == "migration_step":
        return _report_step(node, command, report)
    if command.kind in ("launch_workers", "stop_workers"):
        return _report_workers(node, command, report)
    return _report_plain(node, command, report)


def report_step(node: Node, step_id: str, attempt: int | None, payload: Any) -> ReportOutcome:
    """A migration step's outcome, addressed by step id (and attempt): the same as reporting the
    node's command for that step."""
    from scheduler.models import MigrationStep
    from scheduler.services.migrations import StepNotForNode, StepNotFound

    step = MigrationStep.objects.filter(step_id=step_id).first()
    if step is None:
        raise StepNotFound(step_id)
    commands = AgentCommand.objects.filter(step=step, kind="migration_step")
    if not commands.filter(node=node).exists():
        raise StepNotForNode(f"step {step_id} does not run on {node.name}")
    mine = commands.filter(node=node).order_by("-created_at", "-id")
    if attempt is not None:
        mine = mine.filter(payload__attempt=attempt)
    command = mine.first()
    if command is None:
        raise StepNotFound(f"{step_id} attempt {attempt}")
    return report_command(node, command.command_id, payload)


def _finish(command: AgentCommand, ok: bool, result: dict[str, Any]) -> None:
    target = CommandState.DONE if ok else CommandState.FAILED
    _check_command(command, target)
    command.state = target
    command.finished_at = timezone.now()
    command.result = result
    command.save(update_fields=["state", "finished_at", "result"])


def _locked_command(pk: int) -> AgentCommand:
    return AgentCommand.objects.select_for_update().get(pk=pk)


def _job(command: AgentCommand) -> Job | None:
    job_id = command.payload.get("job")
    return Job.objects.filter(pk=job_id).first() if isinstance(job_id, int) else None


def _audit_report(node: Node, command: AgentCommand, report: Report, job: Job | None) -> None:
    audit.record(
        Actor.for_agent(node.name),
        "agent.command.report",
        command,
        job=job,
        reason=report.error,
        payload={"kind": command.kind, "ok": report.ok, "state": command.state},
    )


def _report_plain(node: Node, command: AgentCommand, report: Report) -> ReportOutcome:
    with transaction.atomic():
        command = _locked_command(command.pk)
        if command.state in FINISHED_COMMAND_STATES:
            return ReportOutcome(command, repeated=True)
        _finish(command, report.ok, {"ok": report.ok, "error": report.error, "result": report.result})
        _audit_report(node, command, report, _job(command))
    return ReportOutcome(command, repeated=False)


def _report_step(node: Node, command: AgentCommand, report: Report) -> ReportOutcome:
    from scheduler.services import migrations

    with transaction.atomic():
        command = _locked_command(command.pk)
        if command.state in FINISHED_COMMAND_STATES:
            return ReportOutcome(command, repeated=True)
        step = command.payload.get("step", {})
        migrations.report_step(
            node,
            step.get("step_id", ""),
            ok=report.ok,
            error=report.error,
            result=report.result,
            attempt=command.payload.get("attempt"),
        )
        command.refresh_from_db()
        if command.state not in FINISHED_COMMAND_STATES:
            # A report for an attempt the migration has moved past: recorded, but it steers nothing.
            _finish(command, report.ok, {"ok": report.ok, "error": report.error, "result": report.result})
        _audit_report(node, command, report, _job(command))
    return ReportOutcome(command, repeated=False)


def _report_workers(node: Node, command: AgentCommand, report: Report) -> ReportOutcome:
    """launch_workers: starting workers run (the job runs once all do) or fail (the job fails);
    stop_workers: stopping workers stop and their devices are freed. Freed devices go to
    waiting jobs afterwards."""
    actor = Actor.for_agent(node.name)
    freed = False
    with transaction.atomic():
        job_id = command.payload.get("job")
        job = (
            Job.objects.select_for_update(no_key=True).filter(pk=job_id).first()
            if isinstance(job_id, int)
            else None
        )
        command = _locked_command(command.pk)
        if command.state in FINISHED_COMMAND_STATES:
            return ReportOutcome(command, repeated=True)
        names = [
            w["worker"] if isinstance(w, Mapping) else str(w) for w in command.payload.get("workers", [])
        ]
        outcomes = {
            name: report.workers.get(name, {"ok": report.ok, "error": report.error if not report.ok else ""})
            for name in names
        }
        workers = list(Worker.objects.select_for_update().filter(name__in=names).order_by("pk"))
        if command.kind == "launch_workers":
            failed = _apply_launch(workers, outcomes)
            freed = bool(failed)
        else:
            failed = []
            freed = _apply_stop(workers, outcomes)
        all_ok = all(o["ok"] for o in outcomes.values())
        _finish(
            command,
            all_ok,
            {"ok": all_ok, "error": report.error, "result": report.result, "workers": outcomes},
        )
        _audit_report(node, command, report, job)
        if job is not None and not job.is_terminal:
            if failed:
                detail = "; ".join(f"{w}: {outcomes[w]['error'] or 'failed to start'}" for w in failed)
                job_services.transition(job, JobState.FAILED, JobReason.WORKER_FAILED, actor, detail)
                job_services.release_workers(job, reason="a worker of the job failed to start")
            elif (
                command.kind == "launch_workers"
                and job.state == JobState.ADMITTED
                and not Worker.objects.filter(group__job=job, state=WorkerState.STARTING).exists()
            ):
                job_services.transition(job, JobState.RUNNING, JobReason.WORKERS_LAUNCHED, actor)
    if freed:
        _admit_waiting(actor)
    return ReportOutcome(command, repeated=False)


def _apply_launch(workers: list[Worker], outcomes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Starting workers run or fail; returns the names that failed. Workers that moved on meanwhile
    (e.g. stopping because the job was cancelled) are left alone."""
    now = timezone.now()
    failed = []
    for worker in workers:
        if worker.state != WorkerState.STARTING:
            continue
        if outcomes[worker.name]["ok"]:
            worker.check_transition(WorkerState.RUNNING)
            worker.state, worker.started_at = WorkerState.RUNNING, now
            worker.save(update_fields=["state", "started_at"])
        else:
            worker.check_transition(WorkerState.FAILED)
            worker.state, worker.stopped_at = WorkerState.FAILED, now
            worker.save(update_fields=["state", "stopped_at"])
            release_devices(Device.objects.filter(worker=worker))
            failed.append(worker.name)
    return failed


def _apply_stop(workers: list[Worker], outcomes: Mapping[str, Mapping[str, Any]]) -> bool:
    """Stopped workers release their devices; returns whether any device was freed. A worker the
    agent could not stop keeps its devices (they may still be busy) and stays stopping."""
    now = timezone.now()
    freed = False
    for worker in workers:
        if not outcomes[worker.name]["ok"] or worker.state in (WorkerState.STOPPED, WorkerState.FAILED):
            continue
        if worker.state in LIVE_WORKER_STATES:
            worker.check_transition(WorkerState.STOPPING)
            worker.state = WorkerState.STOPPING
        worker.check_transition(WorkerState.STOPPED)
        worker.state, worker.stopped_at = WorkerState.STOPPED, now
        worker.save(update_fields=["state", "stopped_at"])
        freed = release_devices(Device.objects.filter(worker=worker)) > 0 or freed
    return freed
