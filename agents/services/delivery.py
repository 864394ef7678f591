"""Command delivery: handing a node its queued commands (again, when delivered but unanswered too
long; cancelled instead when no longer needed), the long-poll that waits for them, and the Redis
wake-ups that end a long-poll as soon as a command is queued.

The ``post_save`` receiver here must be connected in every process that can queue a command:
``AgentsConfig.ready`` imports this module for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.utils import timezone

from agents.services.command_states import check_command
from cluster.models import AgentCommand, CommandState, Node
from common import audit
from common import redis as common_redis
from common.audit import Actor
from jobs.models import LIVE_WORKER_STATES, Job, Worker, WorkerState

log = logging.getLogger(__name__)

DEFAULT_WAIT_S = 25.0
MAX_WAIT_S = 60.0
MAX_COMMANDS_PER_FETCH = 50
WAIT_JITTER = 0.2  # an empty long-poll answers after wait x U(0.8, 1)
WAKE_CHANNEL = "dynarl:agent:wake"


# --- wake-ups for long-polls -------------------------------------------------------------------------
#
# A command's creation publishes the node's id on one Redis channel. Each server process holds one
# subscription and fans the message out to the long-polls of that node waiting in the process, so
# a thousand waiting agents cost one Redis connection, not a thousand. Wake-ups are best effort:
# a poll also rechecks the database every AGENT_POLL_FALLBACK_S.


def wake_node(node_id: int) -> None:
    """Tell the node's waiting long-polls that a command is queued. Never fails the caller."""
    try:
        common_redis.shared_client().publish(WAKE_CHANNEL, str(node_id))
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
            client = common_redis.async_subscriber()
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


# --- delivery --------------------------------------------------------------------------------------


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
                check_command(command, CommandState.CANCELLED)
                command.state = CommandState.CANCELLED
                command.finished_at = now
                command.result = {"cancelled": why}
                command.save(update_fields=["state", "finished_at", "result"])
                audit.record(actor, "agent.command.cancel", command, job=job, reason=why)
                continue
            check_command(command, CommandState.DELIVERED)
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
