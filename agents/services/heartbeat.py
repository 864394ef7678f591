"""A node's heartbeat: it is alive (a lost node comes back here), its telemetry is ingested, and
its job-progress reports are recorded (``progress``, which also builds the reply's ``jobs``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import connection, transaction

from agents.services import progress
from agents.services.liveness import restore_node
from cluster.models import Node, NodeStatus
from common.audit import Actor
from jobs.admission import admit_pending
from scheduler import telemetry


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
                restore_node(node, actor, why="heartbeat resumed")
                if node.status == NodeStatus.LOST
                else node.status
            )
        admit_pending(actor=actor)
    result = telemetry.ingest_heartbeat(node, beat, now=now)
    return HeartbeatOutcome(node_status=status, ingest=result, recovered=recovered, server_time=now)
