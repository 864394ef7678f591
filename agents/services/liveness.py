"""Node liveness: a node silent for NODE_LOST_AFTER_S is lost (its devices lost, its workers'
groups flagged, the migrations it was in rolled back), and restored when it heartbeats or
registers again.

The liveness check acts as ``Actor.system("liveness")``; every change runs in one transaction with
its AuditEvent.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cluster.models import Device, DeviceStatus, Node, NodeStatus
from common import audit
from common.audit import Actor
from common.models import AuditEvent
from jobs.models import LIVE_WORKER_STATES, WorkerGroup, WorkerState
from scheduler.services import gpu_migrations

NODE_LOST_FLAG_PREFIX = "node lost: "  # WorkerGroup.flag_reason of groups flagged by a lost node
LIVENESS_ACTOR = Actor.system("liveness")


def detect_lost_nodes(now: datetime | None = None) -> list[str]:
    """Mark nodes silent for NODE_LOST_AFTER_S as lost and roll back the migrations they were in."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.NODE_LOST_AFTER_S)
    silent = Node.objects.exclude(status=NodeStatus.LOST).filter(
        Q(last_heartbeat_at__lt=cutoff) | Q(last_heartbeat_at__isnull=True, registered_at__lt=cutoff)
    )
    lost = []
    for node_id in silent.values_list("pk", flat=True):
        node = mark_node_lost(node_id, cutoff=cutoff, now=now)
        if node is not None:
            gpu_migrations.roll_back_node(node, LIVENESS_ACTOR)
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


def restore_node(node: Node, actor: Actor, *, why: str) -> str:
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
