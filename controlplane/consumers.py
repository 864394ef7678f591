"""Live events over WebSocket: one job's page (``/ws/jobs/<id>/``) and the cluster overview
(``/ws/cluster/``), fed by ``common.events.publish`` through the Redis channel layer.

Protocol. Every frame is a JSON object ``{"type": ..., "at": <ISO time>, "data": {...}}``.

Server to client:
  ``hello``            first frame after connecting, and the answer to ``resync``: the current
                       state, so a client that reconnects after missing events starts over from
                       it (job: state, latest snapshot id, last decision id, open migration, open
                       alerts; cluster: summary counts).
  ``job.state``, ``snapshot``, ``decision``, ``migration``, ``migration.step``,
  ``placement_change``, ``telemetry``,
  ``alert``            the events of ``common.events.EVENT_TYPES``, as published.
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
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.utils import timezone

from common import events
from common.roles import role_of
from controlplane.selectors import cluster_hello, job_hello

CLOSE_NOT_AUTHENTICATED = 4401
CLOSE_NO_SUCH_JOB = 4404


def may_watch(user: Any) -> bool:
    """Viewer and up: every role may read every job's live events."""
    return role_of(user) is not None


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
