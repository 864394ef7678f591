"""Live events over WebSocket: one job's page (``/ws/jobs/<id>/``) and the cluster overview
(``/ws/cluster/``), fed by ``controlplane.events.publish`` through the Redis channel layer.

Protocol. Every frame is a JSON object ``{"type": ..., "at": <ISO time>, "data": {...}}``.

Server to client:
  ``hello``            first frame after connecting, and the answer to ``resync``: the current
                       state, so a client that reconnects after missing events starts over from
                       it (job: state, latest snapshot id, last decision id, open migration, open
                       alerts; cluster: summary counts).
  ``job.state``, ``snapshot``, ``decision``, ``migration``, ``migration.step``, ``telemetry``,
  ``alert``            the events of ``controlplane.events.EVENT_TYPES``, as published.
  ``pong``             the answer to ``ping``.
  ``error``            a client frame the server does not understand; the socket stays open.

Client to server: ``{"type": "resync"}`` or ``{"type": "ping"}``.

Who may connect: any authenticated, active user (viewer and up), by session cookie (the
dashboard) or ``?token=<API token>`` (the CLI and scripts). The server accepts and then closes
with a code, so a browser sees why (a refused handshake only shows 1006):
  4401 not authenticated (no session, unknown, revoked or expired token, inactive user)
  4404 no such job
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections import Counter
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.db.models import Count
from django.utils import timezone

from agents.models import Device, DeviceStatus, Node, NodeStatus
from controlplane import events
from controlplane.roles import role_of
from jobs.models import Job, JobState
from scheduler.models import (
    OPEN_MIGRATION_STATES,
    Alert,
    AlertKind,
    HypergraphSnapshot,
    Migration,
    SchedulingDecision,
)

CLOSE_NOT_AUTHENTICATED = 4401
CLOSE_NO_SUCH_JOB = 4404


# --- what a client sees on connect (read-only queries) -------------------------------------------


def may_watch(user: Any) -> bool:
    """Viewer and up: every role may read every job's live events."""
    return role_of(user) is not None


def alert_json(alert: Alert) -> dict[str, Any]:
    return {
        "id": alert.pk,
        "kind": alert.kind,
        "subject": alert.subject,
        "job": alert.job_id,
        "node": alert.node_id,
        "message": alert.message,
        "raised_at": alert.raised_at.isoformat(),
        "cleared_at": alert.cleared_at.isoformat() if alert.cleared_at else None,
    }


def job_hello(job_id: int) -> dict[str, Any] | None:
    """The job's current state for a (re)connecting client; None when there is no such job."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return None
    snapshot = (
        HypergraphSnapshot.objects.filter(job=job)
        .order_by("-taken_at", "-id")
        .values("id", "taken_at")
        .first()
    )
    decision_id = (
        SchedulingDecision.objects.filter(job=job).order_by("-at", "-id").values_list("id", flat=True).first()
    )
    migration = (
        Migration.objects.filter(job=job, state__in=OPEN_MIGRATION_STATES)
        .order_by("-created_at", "-id")
        .values("id", "migration_id", "state", "strategy", "donor", "recipient")
        .first()
    )
    alerts = Alert.objects.filter(job=job, cleared_at__isnull=True).order_by("-raised_at")
    return {
        "scope": "job",
        "job": {
            "id": job.pk,
            "name": job.name,
            "state": job.state,
            "state_reason": job.state_reason,
            "state_detail": job.state_detail,
            "policy": job.policy,
            "iteration": job.iteration,
            "iterations_total": job.iterations_total,
            "tokens_per_s": job.tokens_per_s,
            "total_gpus": job.total_gpus,
        },
        "latest_snapshot_id": snapshot["id"] if snapshot else None,
        "latest_snapshot_at": snapshot["taken_at"].isoformat() if snapshot else None,
        "last_decision_id": decision_id,
        "open_migration": migration,
        "open_alerts": [alert_json(a) for a in alerts],
    }


def _counts(rows: Any, field: str, keys: list[str]) -> dict[str, int]:
    """``{key: count}`` with every key present, zero when no row has it."""
    counted = Counter({row[field]: row["n"] for row in rows})
    return {key: int(counted.get(key, 0)) for key in keys}


def cluster_hello() -> dict[str, Any]:
    """Summary counts of the whole cluster for a (re)connecting overview."""
    jobs = _counts(Job.objects.values("state").annotate(n=Count("id")), "state", list(JobState.values))
    gpus = _counts(
        Device.objects.values("status").annotate(n=Count("id")), "status", list(DeviceStatus.values)
    )
    nodes = _counts(Node.objects.values("status").annotate(n=Count("id")), "status", list(NodeStatus.values))
    alerts = _counts(
        Alert.objects.filter(cleared_at__isnull=True).values("kind").annotate(n=Count("id")),
        "kind",
        list(AlertKind.values),
    )
    return {
        "scope": "cluster",
        "jobs": jobs,
        "queue_length": jobs[JobState.PENDING],
        "gpus": gpus,
        "nodes": nodes,
        "migrations_in_flight": Migration.objects.filter(state__in=OPEN_MIGRATION_STATES).count(),
        "open_alerts": alerts,
    }


# --- consumers --------------------------------------------------------------------------------


class _EventsConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    """Authenticates, joins its groups, says hello, then forwards every published event."""

    joined: list[str]

    async def connect(self) -> None:
        self.joined = []
        # Accept before judging: closing an accepted socket carries the 4xxx code to the client.
        await self.accept()
        if not await database_sync_to_async(may_watch)(self.scope.get("user")):
            await self.refuse(CLOSE_NOT_AUTHENTICATED)
            return
        # Join before reading the state, so nothing published in between is lost; the hello
        # still goes out first because queued events are handled only after connect returns.
        for group in self.event_groups():
            await self.channel_layer.group_add(group, self.channel_name)
            self.joined.append(group)
        hello = await database_sync_to_async(self.current_state)()
        if hello is None:
            await self.refuse(CLOSE_NO_SUCH_JOB)
            return
        await self.send_frame("hello", hello)

    async def disconnect(self, code: int) -> None:
        await self.leave_groups()

    async def leave_groups(self) -> None:
        for group in getattr(self, "joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)
        self.joined = []

    async def refuse(self, code: int) -> None:
        await self.leave_groups()
        await self.close(code=code)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        # Malformed or binary frames get an error frame, not a crashed consumer.
        try:
            content = json.loads(text_data) if text_data is not None else None
        except ValueError:
            content = None
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "resync":
            hello = await database_sync_to_async(self.current_state)()
            if hello is None:
                await self.refuse(CLOSE_NO_SUCH_JOB)
                return
            await self.send_frame("hello", hello)
        elif kind == "ping":
            await self.send_frame("pong", {})
        else:
            await self.send_frame("error", {"message": 'expected {"type": "resync"} or {"type": "ping"}'})

    async def dynarl_event(self, message: dict[str, Any]) -> None:
        """A ``{"type": "dynarl.event", "event", "at", "data"}`` message from the channel layer."""
        await self.send_json({"type": message["event"], "at": message["at"], "data": message["data"]})

    async def send_frame(self, frame_type: str, data: dict[str, Any]) -> None:
        await self.send_json({"type": frame_type, "at": timezone.now().isoformat(), "data": data})

    @abstractmethod
    def event_groups(self) -> list[str]:
        """The channel-layer groups whose events this socket forwards."""

    @abstractmethod
    def current_state(self) -> dict[str, Any] | None:
        """The hello's data; None when the subject does not exist."""


class JobEventsConsumer(_EventsConsumer):
    """``/ws/jobs/<id>/``: one job's events."""

    def job_id(self) -> int:
        return int(self.scope["url_route"]["kwargs"]["job_id"])

    def event_groups(self) -> list[str]:
        return [events.job_group(self.job_id())]

    def current_state(self) -> dict[str, Any] | None:
        return job_hello(self.job_id())


class ClusterEventsConsumer(_EventsConsumer):
    """``/ws/cluster/``: events published with ``cluster=True`` (alerts, finished migrations, ...)."""

    def event_groups(self) -> list[str]:
        return [events.CLUSTER_GROUP]

    def current_state(self) -> dict[str, Any] | None:
        return cluster_hello()
