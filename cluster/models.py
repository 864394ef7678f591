"""The cluster's inventory: GPU hosts (nodes), their accelerators (devices) and the commands
queued for each node's agent. Who owns a device is the source of truth for who holds what.

The tables keep the names they had in the ``agents`` app, where they were first created."""

from __future__ import annotations

from typing import ClassVar

from django.db import models, transaction
from django.utils import timezone


class NodeStatus(models.TextChoices):
    READY = "ready"
    LOST = "lost"  # missed its heartbeats; its in-flight migrations were rolled back
    DRAINED = "drained"  # taken out of admission by an operator


def default_backends() -> list[str]:
    return ["sim"]


class Node(models.Model):
    name = models.CharField(max_length=200, unique=True, help_text="host name the agent registered with")
    status = models.CharField(max_length=16, choices=NodeStatus.choices, default=NodeStatus.READY)
    backend = models.CharField(max_length=16, default="sim", help_text="execution backend: sim or ray")
    backends = models.JSONField(
        default=default_backends,
        help_text="the job backends its agent runs (a job's spec `backend` must be one of them)",
    )
    agent_version = models.CharField(max_length=32, blank=True, default="")
    steps_outlive_agent = models.BooleanField(
        default=False,
        help_text=(
            "its backend's migration steps run on in workers that outlive the agent (ray): a "
            "restarted agent carries an interrupted step out again"
        ),
    )
    labels = models.JSONField(default=dict, blank=True)
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True, db_index=True)
    status_reason = models.TextField(blank=True, default="")

    class Meta:
        db_table = "agents_node"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def offers(self, backend: str) -> bool:
        """Does this node's agent run jobs of ``backend``?"""
        return backend in self.backends


def offering(backend: str, *, via: str = "") -> models.Q:
    """Rows whose node's agent runs jobs of ``backend``: nodes, or with ``via="node__"`` devices."""
    return models.Q(**{f"{via}backends__contains": [backend]})


class DeviceStatus(models.TextChoices):
    FREE = "free"
    ALLOCATED = "allocated"
    LOST = "lost"


class Device(models.Model):
    """One accelerator. ``worker`` is its owner; it changes only when a migration commits."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    index = models.PositiveIntegerField(help_text="index on the host (CUDA ordinal)")
    uid = models.CharField(max_length=255, unique=True, help_text="cluster-wide id, e.g. node-a/gpu3")
    hardware = models.CharField(max_length=32, db_index=True, help_text="hardware type, e.g. H100")
    memory_gb = models.FloatField(default=80.0)
    status = models.CharField(max_length=16, choices=DeviceStatus.choices, default=DeviceStatus.FREE)
    worker = models.ForeignKey(
        "jobs.Worker", null=True, blank=True, on_delete=models.SET_NULL, related_name="devices"
    )
    reserved_by = models.CharField(
        max_length=128,
        blank=True,
        default="",
        db_index=True,
        help_text="the open migration that will hand this free device to a new worker when it commits",
    )
    utilisation = models.FloatField(default=0.0, help_text="latest reported, 0..1")
    memory_used_gb = models.FloatField(default=0.0)
    reading_source = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text=(
            "what measured the latest reading: nvml (the GPU driver), process_cpu (the CPU share of "
            "the worker processes holding the device, on a host without NVML) or simulated"
        ),
    )
    reported_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "agents_device"
        ordering = ["node__name", "index"]
        constraints: ClassVar = [
            models.UniqueConstraint(fields=["node", "index"], name="device_unique_index_per_node"),
            # A free device has no owner. An owned device is allocated, or lost with its node: it
            # keeps its owner then, and is allocated again when the node comes back.
            models.CheckConstraint(
                condition=(models.Q(worker__isnull=True) | models.Q(status__in=["allocated", "lost"])),
                name="device_owned_only_when_allocated_or_lost",
            ),
            # A reservation holds a device nobody owns yet; the commit that hands it out clears it.
            models.CheckConstraint(
                condition=(models.Q(reserved_by="") | models.Q(worker__isnull=True)),
                name="device_reserved_only_when_unowned",
            ),
        ]

    def __str__(self) -> str:
        return self.uid


# The one definition of a device that may be handed out: nobody owns it, no open migration has
# reserved it, its node is ready. Admission, the tick's free pool and the API's counts all use it.
FREE_DEVICE = models.Q(status=DeviceStatus.FREE, worker__isnull=True, reserved_by="") & models.Q(
    node__status=NodeStatus.READY
)


def release_devices(devices: models.QuerySet[Device]) -> int:
    """Drop the devices' owner: they become free, or stay lost while their node is lost (a node
    that comes back frees them). Returns how many were released."""
    on_lost_node = models.Q(node__status=NodeStatus.LOST)
    lost = devices.filter(on_lost_node).update(worker=None, status=DeviceStatus.LOST)
    return lost + devices.exclude(on_lost_node).update(worker=None, status=DeviceStatus.FREE)


class DevicesNoLongerFree(Exception):
    """Some devices a migration wanted from the free pool were taken or reserved meanwhile."""

    def __init__(self, uids: list[str]) -> None:
        super().__init__(f"devices no longer free: {', '.join(uids)}")
        self.uids = uids


def reserve_devices(uids: list[str], *, migration_id: str) -> None:
    """Reserve free devices for ``migration_id``, all or none: a conditional update, so of two
    transactions wanting the same device the second finds it taken (PostgreSQL re-checks the
    condition once the first commits). Raises DevicesNoLongerFree, reserving nothing."""
    wanted = sorted(set(uids))
    with transaction.atomic():
        got = Device.objects.filter(FREE_DEVICE, uid__in=wanted).update(reserved_by=migration_id)
        if got != len(wanted):
            free = set(Device.objects.filter(FREE_DEVICE, uid__in=wanted).values_list("uid", flat=True))
            raise DevicesNoLongerFree([u for u in wanted if u not in free])


def end_reservations(migration_id: str) -> int:
    """The migration ended: what it reserved and did not hand out is free again."""
    return Device.objects.filter(reserved_by=migration_id).update(reserved_by="")


class CommandState(models.TextChoices):
    QUEUED = "queued"
    DELIVERED = "delivered"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class AgentCommand(models.Model):
    """Work for one node's agent, delivered by long-poll. Idempotent by ``command_id``."""

    command_id = models.CharField(max_length=128, unique=True)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=32, help_text="launch_workers, stop_workers or migration_step")
    payload = models.JSONField(default=dict)
    step = models.ForeignKey(
        "scheduler.MigrationStep", null=True, blank=True, on_delete=models.CASCADE, related_name="commands"
    )
    state = models.CharField(max_length=16, choices=CommandState.choices, default=CommandState.QUEUED)
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    deliveries = models.PositiveIntegerField(default=0)
    result = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "agents_agentcommand"
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["node", "state", "created_at"])]

    def __str__(self) -> str:
        return f"{self.kind} {self.command_id} -> {self.node}"
