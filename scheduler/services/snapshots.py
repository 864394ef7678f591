"""Hypergraph snapshots: on every change of allocation, and at least every SNAPSHOT_EVERY_S."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from django.conf import settings
from django.utils import timezone

from common import events
from jobs.models import Job
from scheduler.core.hypergraph import SCHEMA_VERSION, Hypergraph
from scheduler.core.signals import GroupSignals
from scheduler.models import HypergraphSnapshot
from scheduler.services.graph import build_hypergraph


def allocation_digest(graph: Hypergraph) -> str:
    canonical = json.dumps(graph.allocation(), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def take(
    job: Job,
    *,
    cause: str,
    graph: Hypergraph | None = None,
    signals: Mapping[str, GroupSignals] | None = None,
    force: bool = True,
) -> HypergraphSnapshot | None:
    """Store a snapshot; with ``force=False`` only when the allocation changed or the last is old."""
    now = timezone.now()
    graph = graph or build_hypergraph(job, signals=signals, taken_at=now.timestamp())
    digest = allocation_digest(graph)
    if not force and digest == job.last_snapshot_digest and job.last_snapshot_at is not None:
        if (now - job.last_snapshot_at).total_seconds() < settings.SNAPSHOT_EVERY_S:
            return None
        cause = "periodic"
    elif not force:
        cause = "change"
    data = graph.to_json()
    if signals:
        data["signals"] = {gid: s.to_json() for gid, s in signals.items()}
    snapshot = HypergraphSnapshot.objects.create(
        job=job,
        taken_at=now,
        schema_version=SCHEMA_VERSION,
        iteration=graph.iteration,
        digest=digest,
        cause=cause,
        data=data,
    )
    Job.objects.filter(pk=job.pk).update(last_snapshot_at=now, last_snapshot_digest=digest)
    job.last_snapshot_at, job.last_snapshot_digest = now, digest
    events.publish(
        "snapshot",
        {"id": snapshot.pk, "cause": cause, "taken_at": now.isoformat(), "allocation": graph.allocation()},
        job_id=job.pk,
    )
    return snapshot
