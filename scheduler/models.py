"""What the scheduling loop decided and did, kept for audit: snapshots, decisions, migrations,
steps, predictor errors, telemetry, ticks and alerts."""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.utils import timezone

from common.transitions import check_transition


class HypergraphSnapshot(models.Model):
    """The whole hypergraph of a job at an instant (scheduler.core.hypergraph JSON)."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="snapshots")
    taken_at = models.DateTimeField(default=timezone.now)
    schema_version = models.PositiveIntegerField()
    iteration = models.PositiveIntegerField(default=0)
    digest = models.CharField(max_length=64, help_text="sha256 of the allocation, to store on change")
    cause = models.CharField(max_length=16, help_text="admission, change, periodic or migration")
    data = models.JSONField()

    class Meta:
        ordering = ["-taken_at", "-id"]
        indexes = [models.Index(fields=["job", "-taken_at"])]

    def __str__(self) -> str:
        return f"snapshot of job {self.job_id} at {self.taken_at:%H:%M:%S}"


class SchedulingDecision(models.Model):
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="decisions")
    tick = models.ForeignKey(
        "Tick", null=True, blank=True, on_delete=models.SET_NULL, related_name="decisions"
    )
    at = models.DateTimeField(default=timezone.now)
    policy = models.CharField(max_length=32)
    reason = models.CharField(max_length=48, db_index=True)
    detail = models.TextField(blank=True, default="")
    donor = models.CharField(max_length=64, blank=True, default="")
    recipient = models.CharField(max_length=64, blank=True, default="")
    device_uids = models.JSONField(default=list)
    inputs = models.JSONField(default=dict, help_text="summary of the signals the policy read")
    candidates = models.JSONField(default=list)
    chosen = models.JSONField(null=True, blank=True)
    requested_by = models.CharField(max_length=200, default="scheduler")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["job", "-at"])]

    def __str__(self) -> str:
        return f"decision {self.pk} of job {self.job_id}: {self.reason}"


class MigrationState(models.TextChoices):
    PLANNED = "planned"
    RUNNING = "running"
    ROLLING_BACK = "rolling_back"
    COMMITTED = "committed"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


MIGRATION_TRANSITIONS: dict[str, frozenset[str]] = {
    MigrationState.PLANNED: frozenset({MigrationState.RUNNING, MigrationState.ROLLED_BACK}),
    MigrationState.RUNNING: frozenset(
        {MigrationState.COMMITTED, MigrationState.ROLLING_BACK, MigrationState.FAILED}
    ),
    MigrationState.ROLLING_BACK: frozenset({MigrationState.ROLLED_BACK, MigrationState.FAILED}),
    MigrationState.COMMITTED: frozenset(),
    MigrationState.ROLLED_BACK: frozenset(),
    MigrationState.FAILED: frozenset(),
}
OPEN_MIGRATION_STATES = frozenset(
    {MigrationState.PLANNED, MigrationState.RUNNING, MigrationState.ROLLING_BACK}
)


class Migration(models.Model):
    """Moving devices between two groups of one job, as an ordered plan of steps."""

    migration_id = models.CharField(max_length=64, unique=True)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="migrations")
    decision = models.OneToOneField(
        SchedulingDecision, null=True, blank=True, on_delete=models.SET_NULL, related_name="migration"
    )
    donor = models.CharField(max_length=64, blank=True, default="")
    recipient = models.CharField(max_length=64, blank=True, default="")
    strategy = models.CharField(max_length=32, help_text="donor+recipient strategies, e.g. workload+p2p")
    device_uids = models.JSONField(default=list)
    state = models.CharField(max_length=16, choices=MigrationState.choices, default=MigrationState.PLANNED)
    plan = models.JSONField(help_text="scheduler.core.migration.MigrationPlan JSON")
    execution = models.JSONField(default=dict, help_text="scheduler.core.migration.PlanExecution JSON")
    estimated_s = models.FloatField(default=0.0)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    requested_by = models.CharField(max_length=200, default="scheduler")
    settled = models.BooleanField(default=False, help_text="predictor error recorded")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["job", "state", "-created_at"]),
            models.Index(fields=["state", "-created_at"]),
        ]

    def __str__(self) -> str:
        return f"migration {self.migration_id} ({self.state})"

    def check_transition(self, target: str) -> None:
        check_transition("migration", MIGRATION_TRANSITIONS, self.state, target)

    @property
    def duration_s(self) -> float | None:
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None


class PlacementChangeState(models.TextChoices):
    STOPPING = "stopping"  # the job's workers are being stopped
    LAUNCHING = "launching"  # the new layout's workers are being started
    DONE = "done"
    FAILED = "failed"


PLACEMENT_CHANGE_TRANSITIONS: dict[str, frozenset[str]] = {
    PlacementChangeState.STOPPING: frozenset({PlacementChangeState.LAUNCHING, PlacementChangeState.FAILED}),
    PlacementChangeState.LAUNCHING: frozenset({PlacementChangeState.DONE, PlacementChangeState.FAILED}),
    PlacementChangeState.DONE: frozenset(),
    PlacementChangeState.FAILED: frozenset(),
}
OPEN_PLACEMENT_CHANGE_STATES = frozenset({PlacementChangeState.STOPPING, PlacementChangeState.LAUNCHING})


class PlacementChange(models.Model):
    """A synchronous job placed anew at an iteration boundary (colocated <-> disaggregated): its
    workers stop, then the new layout's workers start on the same devices, which stay reserved
    for the job in between. ``detail`` is the policy's reasoning."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="placement_changes")
    iteration = models.PositiveIntegerField(help_text="the first iteration run under the new placement")
    from_placement = models.CharField(max_length=16)
    to_placement = models.CharField(max_length=16)
    detail = models.TextField(blank=True, default="")
    layout = models.JSONField(help_text="group -> one list of device uids per new worker")
    old_workers = models.JSONField(default=list)
    new_workers = models.JSONField(default=list)
    state = models.CharField(
        max_length=16, choices=PlacementChangeState.choices, default=PlacementChangeState.STOPPING
    )
    created_at = models.DateTimeField(default=timezone.now)
    launched_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    requested_by = models.CharField(max_length=200, default="scheduler")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["job", "state", "-created_at"])]

    def __str__(self) -> str:
        return (
            f"placement change {self.pk} of job {self.job_id}: {self.from_placement} -> {self.to_placement}"
        )

    @property
    def reservation(self) -> str:
        """What the job's devices are reserved as between the old workers and the new ones."""
        return f"placement-change-{self.pk}"

    def check_transition(self, target: str) -> None:
        check_transition("placement change", PLACEMENT_CHANGE_TRANSITIONS, self.state, target)


class StepState(models.TextChoices):
    PLANNED = "planned"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    SKIPPED = "skipped"


STEP_TRANSITIONS: dict[str, frozenset[str]] = {
    StepState.PLANNED: frozenset({StepState.RUNNING, StepState.SKIPPED}),
    StepState.RUNNING: frozenset({StepState.DONE, StepState.FAILED, StepState.SKIPPED}),
    StepState.DONE: frozenset({StepState.ROLLED_BACK}),
    StepState.FAILED: frozenset({StepState.RUNNING, StepState.ROLLED_BACK}),  # retried, or compensated
    StepState.ROLLED_BACK: frozenset(),
    StepState.SKIPPED: frozenset(),
}


class MigrationStep(models.Model):
    migration = models.ForeignKey(Migration, on_delete=models.CASCADE, related_name="steps")
    step_id = models.CharField(max_length=128, unique=True, help_text="idempotency key of the step")
    index = models.PositiveIntegerField()
    kind = models.CharField(max_length=32)
    group = models.CharField(max_length=64)
    nodes = models.JSONField(default=list, help_text="names of the nodes whose agents execute the step")
    device_uids = models.JSONField(default=list)
    worker_names = models.JSONField(default=list)
    attempts = models.PositiveIntegerField(default=0)
    is_rollback = models.BooleanField(default=False)
    point_of_no_return = models.BooleanField(default=False)
    state = models.CharField(max_length=16, choices=StepState.choices, default=StepState.PLANNED)
    estimated_s = models.FloatField(default=0.0)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    result = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["migration", "index"]
        constraints: ClassVar = [
            models.UniqueConstraint(fields=["migration", "index"], name="step_unique_index_per_migration")
        ]

    def __str__(self) -> str:
        return f"{self.step_id} ({self.state})"

    def check_transition(self, target: str) -> None:
        check_transition("migration step", STEP_TRANSITIONS, self.state, target)

    @property
    def duration_s(self) -> float | None:
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None


class PredictorScope(models.TextChoices):
    DONOR = "donor"
    RECIPIENT = "recipient"
    JOB = "job"


class PredictorSample(models.Model):
    """Predicted vs observed throughput once a committed migration has settled."""

    migration = models.ForeignKey(Migration, on_delete=models.CASCADE, related_name="predictor_samples")
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="predictor_samples")
    scope = models.CharField(max_length=16, choices=PredictorScope.choices)
    group = models.CharField(max_length=64, blank=True, default="")
    component = models.CharField(max_length=16, blank=True, default="")
    predicted = models.FloatField()
    observed = models.FloatField()
    recorded_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-recorded_at", "-id"]
        constraints: ClassVar = [
            models.UniqueConstraint(fields=["migration", "scope"], name="predictor_sample_once_per_scope")
        ]
        indexes = [models.Index(fields=["job", "-recorded_at"]), models.Index(fields=["component"])]

    def __str__(self) -> str:
        return f"{self.scope} of {self.migration_id}: {self.predicted:.1f} vs {self.observed:.1f}"

    @property
    def abs_pct_error(self) -> float | None:
        if self.observed == 0:
            return None
        return abs(self.predicted - self.observed) / abs(self.observed) * 100


class TelemetrySample(models.Model):
    """Per-worker telemetry, downsampled to one row per worker per bucket (see TELEMETRY_BUCKET_S)."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="telemetry")
    group = models.CharField(max_length=64)
    worker = models.CharField(max_length=128)
    node = models.ForeignKey("cluster.Node", null=True, on_delete=models.SET_NULL, related_name="+")
    bucket_start = models.DateTimeField()
    samples = models.PositiveIntegerField(default=0)
    utilisation_mean = models.FloatField(default=0.0)
    utilisation_min = models.FloatField(default=0.0)
    tokens = models.BigIntegerField(default=0)
    queue_length = models.PositiveIntegerField(default=0)
    in_flight = models.PositiveIntegerField(default=0)
    waiting_mean = models.FloatField(
        null=True,
        blank=True,
        help_text="mean share of the bucket the worker sat idle waiting for input (a trainer rank "
        "waiting for data), 0..1; null where its backend does not measure it",
    )

    class Meta:
        ordering = ["-bucket_start"]
        constraints: ClassVar = [
            models.UniqueConstraint(fields=["worker", "bucket_start"], name="telemetry_one_row_per_bucket")
        ]
        indexes = [
            models.Index(fields=["job", "group", "-bucket_start"]),
            models.Index(fields=["bucket_start"]),
        ]

    def __str__(self) -> str:
        return f"{self.worker}@{self.bucket_start:%H:%M:%S}"


class GroupSignalsRecord(models.Model):
    """The latest signals of a worker group, as the last tick computed them."""

    group = models.OneToOneField("jobs.WorkerGroup", on_delete=models.CASCADE, related_name="signals")
    computed_at = models.DateTimeField(default=timezone.now)
    data = models.JSONField(help_text="scheduler.core.signals.GroupSignals JSON")

    def __str__(self) -> str:
        return f"signals of {self.group}"


TICK_NOTE_CHARS = 500


class Tick(models.Model):
    """One run of the scheduling loop for one job, with its own duration."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="ticks")
    started_at = models.DateTimeField(default=timezone.now)
    duration_ms = models.FloatField(default=0.0)
    policy_ms = models.FloatField(default=0.0)
    outcome = models.CharField(max_length=32, help_text="no_change, decided, migration_in_flight, ...")
    decision_count = models.PositiveIntegerField(default=0)
    note = models.CharField(
        max_length=TICK_NOTE_CHARS,
        blank=True,
        default="",
        help_text="why the policy moved nothing: the best move it weighed and why it lost",
    )

    class Meta:
        ordering = ["-started_at", "-id"]
        indexes = [models.Index(fields=["job", "-started_at"])]

    def __str__(self) -> str:
        return f"tick of job {self.job_id} at {self.started_at:%H:%M:%S} ({self.outcome})"


class AlertKind(models.TextChoices):
    WORKER_STUCK = "worker_stuck"
    THROUGHPUT_COLLAPSE = "throughput_collapse"
    HEARTBEAT_GAP = "heartbeat_gap"


class Alert(models.Model):
    """An anomaly (as AReaL's monitoring raises them), cleared when it recovers."""

    kind = models.CharField(max_length=32, choices=AlertKind.choices)
    subject = models.CharField(max_length=200, help_text="worker, job or node the alert is about")
    job = models.ForeignKey(
        "jobs.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="alerts"
    )
    node = models.ForeignKey(
        "cluster.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="alerts"
    )
    message = models.TextField()
    raised_at = models.DateTimeField(default=timezone.now)
    cleared_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-raised_at"]
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["kind", "subject"], condition=models.Q(cleared_at__isnull=True), name="one_open_alert"
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.subject}"
