"""Live events to browsers over the Channels layer (Redis).

Groups: ``job.<id>`` for one job's page, ``cluster`` for the overview. Event types are typed
strings (job.state, snapshot, decision, migration.step, telemetry, alert); the payload is JSON.
Publishing never fails the caller: a mutation has already committed when it publishes.
``controlplane.consumers`` forwards them to WebSocket clients (the frame format is described there).

Besides ``publish``, ``publish_job_state`` builds the payload of a job's state change for whoever
changes it; the periodic telemetry roll-ups are ``scheduler.services.rollups``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.utils import timezone

log = logging.getLogger(__name__)

EVENT_TYPES = frozenset(
    {
        "job.state",
        "snapshot",
        "decision",
        "migration",
        "migration.step",
        "placement_change",
        "telemetry",
        "alert",
    }
)


def job_group(job_id: int) -> str:
    return f"job.{job_id}"


CLUSTER_GROUP = "cluster"


def _send(group: str, event_type: str, data: Mapping[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    message = {
        "type": "dynarl.event",
        "event": event_type,
        "at": timezone.now().isoformat(),
        "data": dict(data),
    }
    try:
        async_to_sync(layer.group_send)(group, message)
    except Exception:  # the broker being down must not undo a committed change
        log.warning("could not publish %s to %s", event_type, group, exc_info=True)


def publish(
    event_type: str, data: Mapping[str, Any], *, job_id: int | None = None, cluster: bool = False
) -> None:
    """Send after the current transaction commits (at once when there is none)."""
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}")

    def send() -> None:
        if job_id is not None:
            _send(job_group(job_id), event_type, data)
        if cluster:
            _send(CLUSTER_GROUP, event_type, data)

    transaction.on_commit(send)


def publish_job_state(job: Any, previous: str) -> None:
    """A job changed state (call inside the transaction that changed it): its page and the overview."""
    publish(
        "job.state",
        {
            "job": job.pk,
            "from": previous,
            "state": job.state,
            "reason": job.state_reason,
            "detail": job.state_detail,
        },
        job_id=job.pk,
        cluster=True,
    )
