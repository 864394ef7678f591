"""REST representations of jobs, their transitions, worker groups, workers and their devices."""

# mypy: disallow-subclassing-any=False
# (rest_framework ships no type information; its base classes are Any.)

from __future__ import annotations

from rest_framework import serializers

from cluster.models import Device
from jobs.models import IterationResult, Job, JobTransition, Worker, WorkerGroup


class JobSerializer(serializers.ModelSerializer):
    """A job in lists: identity, state with its typed reason, size and progress."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    allocated_gpus = serializers.IntegerField(
        read_only=True, help_text="devices its workers own now (total_gpus is what the spec asked for)"
    )

    class Meta:
        model = Job
        fields: tuple[str, ...] = (
            "id",
            "name",
            "owner",
            "state",
            "state_reason",
            "state_detail",
            "priority",
            "policy",
            "backend",
            "spec_format",
            "total_gpus",
            "allocated_gpus",
            "iteration",
            "iterations_total",
            "tokens_per_s",
            "submitted_at",
            "admitted_at",
            "started_at",
            "finished_at",
            "last_tick_at",
        )
        read_only_fields: tuple[str, ...] = fields


class JobTransitionSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobTransition
        fields: tuple[str, ...] = ("from_state", "to_state", "reason", "detail", "actor", "at")
        read_only_fields: tuple[str, ...] = fields


class DeviceRefSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name", read_only=True)

    class Meta:
        model = Device
        fields: tuple[str, ...] = (
            "uid",
            "node",
            "index",
            "hardware",
            "memory_gb",
            "status",
            "utilisation",
            "reported_at",
        )
        read_only_fields: tuple[str, ...] = fields


class WorkerSerializer(serializers.ModelSerializer):
    devices = DeviceRefSerializer(many=True, read_only=True, help_text="devices this worker owns")
    colocated_devices = DeviceRefSerializer(
        many=True, read_only=True, help_text="devices it time-shares with another worker of the job"
    )

    class Meta:
        model = Worker
        fields: tuple[str, ...] = (
            "name",
            "state",
            "utilisation",
            "created_at",
            "started_at",
            "stopped_at",
            "devices",
            "colocated_devices",
        )
        read_only_fields: tuple[str, ...] = fields


class WorkerGroupSerializer(serializers.ModelSerializer):
    """A HyperNode: one component's workers and the devices they hold now.

    Expects ``current_workers`` prefetched (see ``jobs.selectors.with_allocation``)."""

    gpus = serializers.SerializerMethodField(help_text="devices owned by its current workers")
    workers = WorkerSerializer(
        source="current_workers",
        many=True,
        read_only=True,
        help_text="workers that hold devices or are about to (starting, running, stopping)",
    )
    signals = serializers.JSONField(
        source="signals.data",
        read_only=True,
        allow_null=True,
        help_text="the latest signals the tick computed",
    )
    signals_at = serializers.DateTimeField(source="signals.computed_at", read_only=True, allow_null=True)

    class Meta:
        model = WorkerGroup
        fields: tuple[str, ...] = (
            "id",
            "job",
            "name",
            "kind",
            "scaling",
            "interruptibility",
            "tp",
            "pp",
            "valid_dp",
            "min_workers",
            "max_workers",
            "hardware",
            "depends_on",
            "initial_workers",
            "flagged",
            "flag_reason",
            "gpus",
            "workers",
            "signals",
            "signals_at",
        )
        read_only_fields: tuple[str, ...] = fields

    def get_gpus(self, group: WorkerGroup) -> int:
        workers: list[Worker] = group.current_workers  # type: ignore[attr-defined]
        return sum(len(w.devices.all()) for w in workers)


class JobDetailSerializer(JobSerializer):
    """A job with its spec, its history and its current allocation."""

    transitions = JobTransitionSerializer(many=True, read_only=True)
    groups = WorkerGroupSerializer(
        many=True, read_only=True, help_text="worker groups with their workers and devices"
    )

    class Meta(JobSerializer.Meta):
        fields: tuple[str, ...] = (
            *JobSerializer.Meta.fields,
            "tick_seconds",
            "last_snapshot_at",
            "idempotency_key",
            "spec",
            "transitions",
            "groups",
        )
        read_only_fields: tuple[str, ...] = fields


class JobActionSerializer(serializers.Serializer):
    detail = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=2000,
        default="",
        help_text="why; kept with the transition",
    )


class IterationResultSerializer(serializers.ModelSerializer):
    """One iteration of a real job as its driver measured it."""

    class Meta:
        model = IterationResult
        fields = ("iteration", "mean_reward", "metrics", "node", "recorded_at")
        read_only_fields = fields
