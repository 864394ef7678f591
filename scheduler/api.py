"""REST endpoints (read-only, viewers and up) for what the scheduling loop decided and did:
snapshots, decisions, migrations with their steps (and exports), predictor samples with error
statistics, ticks and alerts."""

# mypy: disallow-subclassing-any=False, disallow-untyped-decorators=False
# (rest_framework ships no type information; its base classes and @action are Any.)

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db.models import Avg, Count, F, FloatField, Max, Prefetch, QuerySet
from django.db.models.functions import Abs, NullIf
from django.shortcuts import get_object_or_404
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import JSONParser
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from common.api import exports
from common.api.filters import BIGINT_MAX, BIGINT_MIN
from common.api.schema import error_response
from common.audit import Actor
from jobs.models import Job
from scheduler import selectors
from scheduler.filters import (
    AlertFilter,
    DecisionFilter,
    MigrationFilter,
    PredictorSampleFilter,
    SnapshotFilter,
    TickFilter,
)
from scheduler.models import (
    Alert,
    HypergraphSnapshot,
    Migration,
    MigrationStep,
    PredictorSample,
    SchedulingDecision,
    Tick,
)
from scheduler.serializers import (
    AlertSerializer,
    DecisionSerializer,
    ManualMigrationSerializer,
    MigrationDetailSerializer,
    MigrationSerializer,
    MigrationStepSerializer,
    PredictorSampleSerializer,
    PredictorSummarySerializer,
    SnapshotSerializer,
    SnapshotSummarySerializer,
    TickSerializer,
)
from scheduler.services.gpu_migrations import request_manual_migration

# --- snapshots ---------------------------------------------------------------------------------


class LatestSnapshotQuery(serializers.Serializer):
    job = serializers.IntegerField(min_value=BIGINT_MIN, max_value=BIGINT_MAX, help_text="job id")
    at = serializers.DateTimeField(required=False, help_text="the last snapshot at or before this time")


class SnapshotViewSet(viewsets.ReadOnlyModelViewSet):
    """Hypergraph snapshots of jobs, newest first. Lists leave the hypergraph out; the detail and
    ``latest`` carry it."""

    filter_backends = [DjangoFilterBackend]
    filterset_class = SnapshotFilter

    def get_queryset(self) -> QuerySet[HypergraphSnapshot]:
        snapshots = HypergraphSnapshot.objects.order_by("-taken_at", "-id")
        return snapshots.defer("data") if self.action == "list" else snapshots

    def get_serializer_class(self) -> type[SnapshotSummarySerializer]:
        return SnapshotSummarySerializer if self.action == "list" else SnapshotSerializer

    @extend_schema(
        parameters=[LatestSnapshotQuery],
        responses={
            200: SnapshotSerializer,
            404: OpenApiResponse(description="no snapshot (yet) at that time"),
        },
        filters=False,
    )
    @action(detail=False, methods=["get"], pagination_class=None, filter_backends=[])
    def latest(self, request: Request) -> Response:
        """A job's newest snapshot, or with ``at`` the last one taken at or before that time."""
        query = LatestSnapshotQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        snapshots = HypergraphSnapshot.objects.filter(job_id=query.validated_data["job"])
        if "at" in query.validated_data:
            snapshots = snapshots.filter(taken_at__lte=query.validated_data["at"])
        snapshot = get_object_or_404(snapshots.order_by("-taken_at", "-id")[:1])
        return Response(SnapshotSerializer(snapshot).data)


# --- decisions ---------------------------------------------------------------------------------


class DecisionViewSet(viewsets.ReadOnlyModelViewSet):
    """Scheduling decisions with the signals the policy read, the candidates it weighed and the
    plan it chose, newest first."""

    serializer_class = DecisionSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = DecisionFilter

    def get_queryset(self) -> QuerySet[SchedulingDecision]:
        return SchedulingDecision.objects.select_related("migration").order_by("-at", "-id")


# --- migrations --------------------------------------------------------------------------------

MIGRATION_CSV_COLUMNS = (
    "id",
    "migration_id",
    "job",
    "state",
    "strategy",
    "donor",
    "recipient",
    "device_uids",
    "estimated_s",
    "duration_s",
    "created_at",
    "started_at",
    "finished_at",
    "requested_by",
    "settled",
    "steps",
    "error",
)
STEP_CSV_COLUMNS = (
    "migration_id",
    "job",
    "step_id",
    "index",
    "kind",
    "group",
    "nodes",
    "device_uids",
    "worker_names",
    "is_rollback",
    "point_of_no_return",
    "state",
    "attempts",
    "estimated_s",
    "duration_s",
    "started_at",
    "finished_at",
    "error",
)


class ExportQuery(serializers.Serializer):
    rows = serializers.ChoiceField(
        choices=["migration", "step"], default="migration", help_text="one row per migration or per step"
    )


def migration_row(migration: Migration) -> list[Any]:
    return [
        migration.pk,
        migration.migration_id,
        migration.job_id,
        migration.state,
        migration.strategy,
        migration.donor,
        migration.recipient,
        migration.device_uids,
        migration.estimated_s,
        migration.duration_s,
        migration.created_at,
        migration.started_at,
        migration.finished_at,
        migration.requested_by,
        migration.settled,
        len(migration.steps.all()),
        migration.error,
    ]


def step_record(step: MigrationStep) -> dict[str, Any]:
    record: dict[str, Any] = {"migration_id": step.migration.migration_id, "job": step.migration.job_id}
    record.update(MigrationStepSerializer(step).data)
    return record


class MigrationViewSet(viewsets.ReadOnlyModelViewSet):
    """Migrations with their steps, newest first; ``export`` streams them as CSV or JSON."""

    filter_backends = [DjangoFilterBackend]
    filterset_class = MigrationFilter

    def get_queryset(self) -> QuerySet[Migration]:
        steps = MigrationStep.objects.order_by("index")
        return Migration.objects.prefetch_related(Prefetch("steps", queryset=steps)).order_by(
            "-created_at", "-id"
        )

    def get_serializer_class(self) -> type[MigrationSerializer]:
        return MigrationDetailSerializer if self.action == "retrieve" else MigrationSerializer

    @extend_schema(
        filters=True,
        parameters=[ExportQuery],
        responses={
            (200, exports.CSV_MEDIA_TYPE): OpenApiResponse(
                OpenApiTypes.STR,
                description="CSV with a header row. rows=migration: "
                + ", ".join(MIGRATION_CSV_COLUMNS)
                + " (steps = how many). rows=step: "
                + ", ".join(STEP_CSV_COLUMNS)
                + ". Lists are space-separated, times ISO 8601.",
            ),
            (200, exports.JSON_MEDIA_TYPE): OpenApiResponse(
                MigrationSerializer(many=True),
                description="a JSON array: migrations with nested steps (rows=migration), or steps "
                "each with migration_id and job (rows=step)",
            ),
        },
    )
    @action(
        detail=False,
        methods=["get"],
        renderer_classes=[exports.CSVRenderer, JSONRenderer],
        pagination_class=None,
    )
    def export(self, request: Request) -> Any:
        """Every matching migration, streamed: ``?format=csv`` (the default, or
        ``Accept: text/csv``) or ``?format=json``; ``rows=step`` for one row per step."""
        query = ExportQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        per_step = query.validated_data["rows"] == "step"
        migrations = self.filter_queryset(self.get_queryset())
        as_json = request.accepted_renderer.format == "json"
        chunk = exports.ROWS_PER_CHUNK
        steps = (
            MigrationStep.objects.filter(migration__in=migrations.values("pk"))
            .select_related("migration")
            .order_by("-migration__created_at", "-migration__pk", "index")
        )
        name = "migration-steps" if per_step else "migrations"

        if as_json:

            def items() -> Iterator[dict[str, Any]]:
                if per_step:
                    for step in steps.iterator(chunk_size=chunk):
                        yield step_record(step)
                else:
                    for migration in migrations.iterator(chunk_size=chunk):
                        yield MigrationSerializer(migration).data

            return exports.streaming_response(
                request._request,
                lambda: exports.json_array(items()),
                content_type=exports.JSON_MEDIA_TYPE,
                filename=f"{name}.json",
            )

        def rows() -> Iterator[list[Any]]:
            if per_step:
                for step in steps.iterator(chunk_size=chunk):
                    record = step_record(step)
                    yield [record[column] for column in STEP_CSV_COLUMNS]
            else:
                for migration in migrations.iterator(chunk_size=chunk):
                    yield migration_row(migration)

        header = STEP_CSV_COLUMNS if per_step else MIGRATION_CSV_COLUMNS
        return exports.streaming_response(
            request._request,
            lambda: exports.csv_lines(header, rows()),
            content_type=exports.CSV_MEDIA_TYPE,
            filename=f"{name}.csv",
        )


# --- predictor samples -------------------------------------------------------------------------


class PredictorSampleViewSet(viewsets.ReadOnlyModelViewSet):
    """Predicted vs observed throughput, recorded once each committed migration settled."""

    serializer_class = PredictorSampleSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = PredictorSampleFilter

    def get_queryset(self) -> QuerySet[PredictorSample]:
        return PredictorSample.objects.select_related("migration").order_by("-recorded_at", "-id")

    @extend_schema(filters=True, responses={200: PredictorSummarySerializer(many=True)})
    @action(detail=False, methods=["get"], pagination_class=None)
    def summary(self, request: Request) -> Response:
        """Count, MAPE and maximum error per component and scope, over the matching samples."""
        samples = self.filter_queryset(self.get_queryset())
        abs_error = Abs(F("predicted") - F("observed"))
        # NULLIF leaves samples that observed 0 out of the percentage errors (they have none).
        pct_error = abs_error / NullIf(Abs(F("observed")), 0.0, output_field=FloatField()) * 100.0
        rows = (
            samples.order_by()
            .values("component", "scope")
            .annotate(
                count=Count("id"),
                mape=Avg(pct_error),
                max_abs_pct_error=Max(pct_error),
                mean_abs_error=Avg(abs_error),
                max_abs_error=Max(abs_error),
            )
            .order_by("component", "scope")
        )
        return Response(PredictorSummarySerializer(list(rows), many=True).data)


# --- ticks and alerts --------------------------------------------------------------------------


class TickViewSet(viewsets.ReadOnlyModelViewSet):
    """Runs of the scheduling loop, with their duration and outcome, newest first."""

    serializer_class = TickSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = TickFilter

    def get_queryset(self) -> QuerySet[Tick]:
        return Tick.objects.order_by("-started_at", "-id")


class AlertViewSet(viewsets.ReadOnlyModelViewSet):
    """Anomalies (a stuck worker, a throughput collapse, heartbeat gaps), open or cleared."""

    serializer_class = AlertSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = AlertFilter

    def get_queryset(self) -> QuerySet[Alert]:
        return Alert.objects.select_related("node").order_by("-raised_at", "-id")


# --- a job's history: GPU ownership timeline and telemetry per group ----------------------------


class TimelineDeviceSerializer(serializers.Serializer):
    uid = serializers.CharField()
    node = serializers.CharField(help_text="empty when the device is no longer registered")
    index = serializers.IntegerField()
    hardware = serializers.CharField()


class OwnershipSerializer(serializers.Serializer):
    device = serializers.CharField(help_text="device uid")
    worker = serializers.CharField()
    group = serializers.CharField()
    kind = serializers.CharField(help_text="component kind of the group")
    start = serializers.DateTimeField(help_text="when the worker was given the device")
    end = serializers.DateTimeField(allow_null=True, help_text="when it let go; null: it still holds it")
    colocated = serializers.BooleanField(help_text="time-shared with another worker of the job")


class MigrationMarkSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    migration_id = serializers.CharField()
    state = serializers.CharField()
    strategy = serializers.CharField()
    donor = serializers.CharField()
    recipient = serializers.CharField()
    device_uids = serializers.ListField(child=serializers.CharField())
    requested_by = serializers.CharField()
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(
        allow_null=True, help_text="for a committed migration, when the devices changed owner"
    )


class TimelineSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    start = serializers.DateTimeField(help_text="admission (or the first holding)")
    end = serializers.DateTimeField(help_text="when the job finished, or now")
    devices = TimelineDeviceSerializer(many=True, help_text="every device the job held, by node and index")
    segments = OwnershipSerializer(many=True, help_text="ordered by device, then start")
    migrations = MigrationMarkSerializer(many=True, help_text="all of the job's migrations, oldest first")


class TelemetryPointSerializer(serializers.Serializer):
    at = serializers.DateTimeField(help_text="start of the telemetry bucket")
    workers = serializers.IntegerField(help_text="workers that reported in the bucket")
    utilisation_mean = serializers.FloatField(help_text="mean over the group's workers, 0..1")
    utilisation_min = serializers.FloatField()
    tokens_per_s = serializers.FloatField(help_text="the group's tokens in the bucket per second")
    queue_length = serializers.IntegerField()
    in_flight = serializers.IntegerField()
    waiting_mean = serializers.FloatField(
        allow_null=True,
        help_text="mean share of the bucket the group's workers sat idle waiting for input (trainer "
        "ranks waiting for data), 0..1; null where not measured",
    )


class GroupSeriesSerializer(serializers.Serializer):
    group = serializers.CharField()
    kind = serializers.CharField()
    points = TelemetryPointSerializer(many=True, help_text="oldest first")


class TelemetryHistorySerializer(serializers.Serializer):
    job = serializers.IntegerField()
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    bucket_s = serializers.FloatField(help_text="seconds per bucket (TELEMETRY_BUCKET_S)")
    groups = GroupSeriesSerializer(many=True, help_text="every group of the job, even without samples yet")


class TelemetryQuery(serializers.Serializer):
    since = serializers.DateTimeField(
        required=False, help_text="buckets starting at or after this time (default: the last hour)"
    )


class JobTimelineView(APIView):
    """Which worker group held each of a job's GPUs over time, with its migrations."""

    @extend_schema(
        responses={200: TimelineSerializer}, operation_id="jobs_timeline", summary="GPU ownership timeline"
    )
    def get(self, request: Request, pk: int) -> Response:
        """Rebuilt from the job's worker rows, snapshots and migrations: one segment per device
        and worker that held it; migrations mark when devices changed hands."""
        job = get_object_or_404(Job, pk=pk)
        return Response(TimelineSerializer(selectors.job_timeline(job)).data)


class JobTelemetryView(APIView):
    """Per-group utilisation and throughput over time."""

    @extend_schema(
        parameters=[TelemetryQuery],
        responses={200: TelemetryHistorySerializer},
        operation_id="jobs_telemetry",
        summary="Utilisation and throughput per group over time",
    )
    def get(self, request: Request, pk: int) -> Response:
        """The job's telemetry buckets aggregated per worker group: mean utilisation, tokens/s,
        queue length. ``since`` fetches only what is newer (e.g. after a reconnect)."""
        job = get_object_or_404(Job, pk=pk)
        query = TelemetryQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        found = selectors.job_telemetry(job, since=query.validated_data.get("since"))
        return Response(TelemetryHistorySerializer(found).data)


class JobMigrateView(APIView):
    """Move workers' GPUs from one group to another by hand (operators)."""

    parser_classes = [JSONParser]  # like the job's other actions: JSON only

    @extend_schema(
        request=ManualMigrationSerializer,
        responses={
            202: OpenApiResponse(MigrationSerializer, description="planned and started; follow its steps"),
            400: error_response(
                "Refused: `fields` names donor, recipient, workers or job (not running, or a "
                "migration already in flight)."
            ),
        },
        operation_id="jobs_migrate_create",
        tags=["jobs"],
    )
    def post(self, request: Request, id: int) -> Response:
        """Move workers' GPUs from one group to another by hand (operators), e.g. from rollout to
        actor. The migration runs through the agents like any other; devices change owner when it
        commits."""
        job = get_object_or_404(Job, pk=id)
        payload = ManualMigrationSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        migration = request_manual_migration(
            job.pk,
            donor=data["donor"],
            recipient=data["recipient"],
            workers=data["workers"],
            actor=Actor.for_user(request.user),
            reason=data["reason"],
        )
        migration = Migration.objects.prefetch_related("steps").get(pk=migration.pk)
        return Response(MigrationSerializer(migration).data, status=status.HTTP_202_ACCEPTED)
