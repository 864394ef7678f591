"""REST representations of what the scheduling loop decided and did."""

# mypy: disallow-subclassing-any=False
# (rest_framework ships no type information; its base classes are Any.)

from __future__ import annotations

from rest_framework import serializers

from scheduler.models import (
    Alert,
    HypergraphSnapshot,
    Migration,
    MigrationStep,
    PredictorSample,
    SchedulingDecision,
    Tick,
)


class SnapshotSummarySerializer(serializers.ModelSerializer):
    """A snapshot without its (large) hypergraph."""

    class Meta:
        model = HypergraphSnapshot
        fields: tuple[str, ...] = ("id", "job", "taken_at", "schema_version", "iteration", "digest", "cause")
        read_only_fields: tuple[str, ...] = fields


class SnapshotSerializer(SnapshotSummarySerializer):
    data = serializers.JSONField(read_only=True, help_text="the hypergraph (scheduler.core.hypergraph JSON)")

    class Meta(SnapshotSummarySerializer.Meta):
        fields: tuple[str, ...] = (*SnapshotSummarySerializer.Meta.fields, "data")
        read_only_fields: tuple[str, ...] = fields


class DecisionSerializer(serializers.ModelSerializer):
    migration = serializers.CharField(
        source="migration.migration_id", read_only=True, allow_null=True, help_text="the migration it started"
    )

    class Meta:
        model = SchedulingDecision
        fields: tuple[str, ...] = (
            "id",
            "job",
            "tick",
            "at",
            "policy",
            "reason",
            "detail",
            "donor",
            "recipient",
            "device_uids",
            "inputs",
            "candidates",
            "chosen",
            "requested_by",
            "migration",
        )
        read_only_fields: tuple[str, ...] = fields


class MigrationStepSerializer(serializers.ModelSerializer):
    duration_s = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = MigrationStep
        fields: tuple[str, ...] = (
            "step_id",
            "index",
            "kind",
            "group",
            "nodes",
            "device_uids",
            "worker_names",
            "attempts",
            "is_rollback",
            "point_of_no_return",
            "state",
            "estimated_s",
            "duration_s",
            "started_at",
            "finished_at",
            "error",
            "result",
        )
        read_only_fields: tuple[str, ...] = fields


class MigrationSerializer(serializers.ModelSerializer):
    duration_s = serializers.FloatField(read_only=True, allow_null=True)
    steps = MigrationStepSerializer(many=True, read_only=True)

    class Meta:
        model = Migration
        fields: tuple[str, ...] = (
            "id",
            "migration_id",
            "job",
            "decision",
            "donor",
            "recipient",
            "strategy",
            "device_uids",
            "state",
            "estimated_s",
            "duration_s",
            "created_at",
            "started_at",
            "finished_at",
            "error",
            "requested_by",
            "settled",
            "steps",
        )
        read_only_fields: tuple[str, ...] = fields


class MigrationDetailSerializer(MigrationSerializer):
    class Meta(MigrationSerializer.Meta):
        fields: tuple[str, ...] = (*MigrationSerializer.Meta.fields, "plan", "execution")
        read_only_fields: tuple[str, ...] = fields


class PredictorSampleSerializer(serializers.ModelSerializer):
    migration = serializers.CharField(source="migration.migration_id", read_only=True)
    abs_pct_error = serializers.FloatField(
        read_only=True,
        allow_null=True,
        help_text="|predicted - observed| / |observed| x 100; null when observed is 0",
    )

    class Meta:
        model = PredictorSample
        fields: tuple[str, ...] = (
            "id",
            "migration",
            "job",
            "scope",
            "group",
            "component",
            "predicted",
            "observed",
            "abs_pct_error",
            "recorded_at",
        )
        read_only_fields: tuple[str, ...] = fields


class PredictorSummarySerializer(serializers.Serializer):
    component = serializers.CharField(help_text="component kind; empty for job-wide samples")
    scope = serializers.CharField(help_text="donor, recipient or job")
    count = serializers.IntegerField()
    mape = serializers.FloatField(
        allow_null=True, help_text="mean absolute percentage error over samples with observed != 0"
    )
    max_abs_pct_error = serializers.FloatField(allow_null=True)
    mean_abs_error = serializers.FloatField(help_text="tokens/s")
    max_abs_error = serializers.FloatField(help_text="tokens/s")


class TickSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tick
        fields: tuple[str, ...] = (
            "id",
            "job",
            "started_at",
            "duration_ms",
            "policy_ms",
            "outcome",
            "decision_count",
            "note",
        )
        read_only_fields: tuple[str, ...] = fields


class AlertSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name", read_only=True, allow_null=True)
    open = serializers.SerializerMethodField()

    class Meta:
        model = Alert
        fields: tuple[str, ...] = (
            "id",
            "kind",
            "subject",
            "job",
            "node",
            "message",
            "raised_at",
            "cleared_at",
            "open",
        )
        read_only_fields: tuple[str, ...] = fields

    def get_open(self, alert: Alert) -> bool:
        return alert.cleared_at is None


class ManualMigrationSerializer(serializers.Serializer):
    donor = serializers.CharField(max_length=64, help_text="group that gives up workers, e.g. rollout")
    recipient = serializers.CharField(max_length=64, help_text="group that receives the devices, e.g. actor")
    workers = serializers.IntegerField(min_value=1, help_text="how many of the donor's workers to move")
    reason = serializers.CharField(required=False, allow_blank=True, max_length=2000, default="")
