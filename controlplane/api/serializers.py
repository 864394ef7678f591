"""Serializers for tokens, whoami, the audit trail, nodes, devices and the cluster summary."""

# mypy: disallow-subclassing-any=False
# (rest_framework ships no type information; its base classes are Any.)

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework import serializers

from cluster.models import Device, DeviceStatus, Node, NodeStatus
from common.models import ApiToken, AuditEvent
from jobs.models import JobState

# --- tokens and identity -----------------------------------------------------------------------


class TokenSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username", read_only=True)
    active = serializers.BooleanField(source="is_active", read_only=True)

    class Meta:
        model = ApiToken
        fields: tuple[str, ...] = (
            "id",
            "name",
            "user",
            "key_prefix",
            "created_at",
            "last_used_at",
            "expires_at",
            "revoked_at",
            "active",
        )
        read_only_fields: tuple[str, ...] = fields


class TokenCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    expires_at = serializers.DateTimeField(
        required=False, allow_null=True, help_text="when the token stops working; never when absent"
    )
    user = serializers.CharField(
        required=False, help_text="username to issue the token for (admins only); yourself when absent"
    )

    def validate_expires_at(self, value: Any) -> Any:
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("must be in the future")
        return value

    def validate_user(self, value: str) -> Any:
        user = get_user_model().objects.filter(username=value).first()
        if user is None:
            raise serializers.ValidationError(f"no user {value!r}")
        return user


class TokenCreatedSerializer(TokenSerializer):
    key = serializers.CharField(read_only=True, help_text="the raw token; shown this once, never again")

    class Meta(TokenSerializer.Meta):
        fields: tuple[str, ...] = (*TokenSerializer.Meta.fields, "key")
        read_only_fields: tuple[str, ...] = fields


class RevokeSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=1000, default="")


class WhoAmISerializer(serializers.Serializer):
    username = serializers.CharField()
    role = serializers.ChoiceField(choices=["admin", "operator", "viewer"])
    is_superuser = serializers.BooleanField()
    groups = serializers.ListField(child=serializers.CharField())
    authentication = serializers.ChoiceField(choices=["session", "token"])
    token = TokenSerializer(allow_null=True, help_text="the token this request used, if any")


# --- audit -------------------------------------------------------------------------------------


class AuditEventSerializer(serializers.ModelSerializer):
    actor_user = serializers.CharField(
        source="actor_user.username", read_only=True, allow_null=True, default=None
    )

    class Meta:
        model = AuditEvent
        fields: tuple[str, ...] = (
            "id",
            "at",
            "actor_type",
            "actor",
            "actor_user",
            "verb",
            "object_type",
            "object_id",
            "job",
            "reason",
            "payload",
            "request_id",
        )
        read_only_fields: tuple[str, ...] = fields


# --- nodes and devices -------------------------------------------------------------------------


class NodeSerializer(serializers.ModelSerializer):
    backends = serializers.ListField(
        child=serializers.CharField(), read_only=True, help_text="the job backends its agent runs"
    )
    devices_total = serializers.IntegerField(read_only=True)
    devices_free = serializers.IntegerField(read_only=True)
    devices_allocated = serializers.IntegerField(read_only=True)
    devices_lost = serializers.IntegerField(read_only=True)
    utilisation_mean = serializers.FloatField(
        read_only=True, allow_null=True, help_text="over its devices, 0..1"
    )
    hardware = serializers.SerializerMethodField(help_text="hardware types of its devices")

    class Meta:
        model = Node
        fields: tuple[str, ...] = (
            "id",
            "name",
            "status",
            "status_reason",
            "backend",
            "backends",
            "agent_version",
            "labels",
            "registered_at",
            "last_heartbeat_at",
            "hardware",
            "devices_total",
            "devices_free",
            "devices_allocated",
            "devices_lost",
            "utilisation_mean",
        )
        read_only_fields: tuple[str, ...] = fields

    def get_hardware(self, node: Node) -> list[str]:
        return sorted({d.hardware for d in node.devices.all()})


class DeviceSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name", read_only=True)
    node_status = serializers.ChoiceField(source="node.status", choices=NodeStatus.choices, read_only=True)
    last_heartbeat_at = serializers.DateTimeField(source="node.last_heartbeat_at", read_only=True)
    job = serializers.IntegerField(
        source="worker.group.job_id", read_only=True, allow_null=True, default=None
    )
    job_name = serializers.CharField(
        source="worker.group.job.name", read_only=True, allow_null=True, default=None
    )
    group = serializers.CharField(source="worker.group.name", read_only=True, allow_null=True, default=None)
    group_kind = serializers.CharField(
        source="worker.group.kind",
        read_only=True,
        allow_null=True,
        default=None,
        help_text="the owning group's component kind (rollout, inference, reward, tool, actor)",
    )
    worker_name = serializers.CharField(source="worker.name", read_only=True, allow_null=True, default=None)
    shared_with = serializers.SerializerMethodField(
        help_text="groups of other workers time-sharing this device (colocated placement)"
    )

    class Meta:
        model = Device
        fields: tuple[str, ...] = (
            "id",
            "uid",
            "node",
            "node_status",
            "index",
            "hardware",
            "memory_gb",
            "memory_used_gb",
            "status",
            "reserved_by",
            "utilisation",
            "reading_source",
            "reported_at",
            "last_heartbeat_at",
            "job",
            "job_name",
            "group",
            "group_kind",
            "worker_name",
            "shared_with",
        )
        read_only_fields: tuple[str, ...] = fields

    def get_shared_with(self, device: Device) -> list[str]:
        # Uses the prefetched colocated workers (see DeviceViewSet) rather than one query each.
        return sorted({worker.group.name for worker in device.colocated_workers.all()})


# --- cluster summary ---------------------------------------------------------------------------


def _count_by(choices: list[str], what: str) -> serializers.DictField:
    return serializers.DictField(
        child=serializers.IntegerField(), help_text=f"{what} per state: {', '.join(choices)}"
    )


class HardwareGpusSerializer(serializers.Serializer):
    hardware = serializers.CharField()
    total = serializers.IntegerField()
    free = serializers.IntegerField()
    allocated = serializers.IntegerField()
    lost = serializers.IntegerField()


class ComponentGpusSerializer(serializers.Serializer):
    group = serializers.CharField()
    kind = serializers.CharField()
    gpus = serializers.IntegerField()
    lost = serializers.IntegerField(help_text="of those, GPUs on a lost node")


class JobGpusSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    name = serializers.CharField()
    state = serializers.ChoiceField(choices=JobState.choices)
    gpus = serializers.IntegerField()
    lost = serializers.IntegerField(help_text="of those, GPUs on a lost node")
    components = ComponentGpusSerializer(many=True)


class ClusterGpusSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    by_status = _count_by([s.value for s in DeviceStatus], "GPUs")
    by_hardware = HardwareGpusSerializer(many=True)
    by_job = JobGpusSerializer(many=True, help_text="GPUs owned by each job's workers, by component")


class ClusterNodesSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    by_status = _count_by([s.value for s in NodeStatus], "nodes")


class ClusterJobsSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    by_state = _count_by([s.value for s in JobState], "jobs")
    queue_length = serializers.IntegerField(help_text="jobs pending admission")


class ClusterSummarySerializer(serializers.Serializer):
    gpus = ClusterGpusSerializer()
    nodes = ClusterNodesSerializer()
    jobs = ClusterJobsSerializer()
    migrations_in_flight = serializers.IntegerField()
    open_alerts = serializers.IntegerField()
