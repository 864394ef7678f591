"""RL jobs, their worker groups (HyperNodes) and workers."""

from __future__ import annotations

from typing import ClassVar

from django.conf import settings
from django.db import models
from django.utils import timezone

from common.transitions import check_transition


class JobState(models.TextChoices):
    PENDING = "pending"
    ADMITTED = "admitted"
    RUNNING = "running"
    PAUSED_SCHEDULING = "paused_scheduling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    JobState.PENDING: frozenset({JobState.ADMITTED, JobState.CANCELLED, JobState.FAILED}),
    JobState.ADMITTED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {JobState.PAUSED_SCHEDULING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.PAUSED_SCHEDULING: frozenset(
        {JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_JOB_STATES = frozenset({JobState.ADMITTED, JobState.RUNNING, JobState.PAUSED_SCHEDULING})


class JobReason(models.TextChoices):
    SUBMITTED = "submitted"
    WAITING_FOR_DEVICES = "waiting_for_devices"
    ADMITTED = "admitted"
    WORKERS_LAUNCHED = "workers_launched"
    PAUSED_BY_OPERATOR = "paused_by_operator"
    RESUMED_BY_OPERATOR = "resumed_by_operator"
    ITERATIONS_COMPLETE = "iterations_complete"
    CANCELLED_BY_OPERATOR = "cancelled_by_operator"
    UNSCHEDULABLE = "unschedulable"
    WORKER_FAILED = "worker_failed"
    NODE_LOST = "node_lost"
    PLACEMENT_CHANGE_FAILED = "placement_change_failed"


class Job(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=100)
    spec = models.JSONField(help_text="the parsed, normalised job spec (jobs.spec.JobSpec.to_json())")
    spec_source = models.TextField(blank=True, default="", help_text="the spec as submitted")
    spec_format = models.CharField(max_length=16, default="dynarl", help_text="dynarl or rlinf")
    priority = models.IntegerField(default=0)
    policy = models.CharField(max_length=32, db_index=True)
    backend = models.CharField(max_length=16, default="sim")
    state = models.CharField(max_length=24, choices=JobState.choices, default=JobState.PENDING)
    state_reason = models.CharField(max_length=32, choices=JobReason.choices, default=JobReason.SUBMITTED)
    state_detail = models.TextField(blank=True, default="")
    idempotency_key = models.CharField(max_length=200, blank=True, default="")
    idempotency_fingerprint = models.CharField(max_length=64, blank=True, default="")
    total_gpus = models.PositiveIntegerField(default=0)
    tick_seconds = models.FloatField(default=1.0)
    iteration = models.PositiveIntegerField(default=0)
    iterations_total = models.PositiveIntegerField(default=1)
    tokens_per_s = models.FloatField(default=0.0, help_text="latest job throughput")
    submitted_at = models.DateTimeField(default=timezone.now, db_index=True)
    admitted_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_tick_at = models.DateTimeField(null=True, blank=True)
    last_snapshot_at = models.DateTimeField(null=True, blank=True)
    last_snapshot_digest = models.CharField(max_length=64, blank=True, default="")
    policy_state = models.JSONField(default=dict, blank=True, help_text="the policy's memory between ticks")

    class Meta:
        ordering = ["-submitted_at", "-id"]
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["owner", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="job_idempotency_key_per_owner",
            ),
        ]
        indexes = [
            models.Index(fields=["state", "-priority", "submitted_at"]),
            models.Index(fields=["owner", "-submitted_at"]),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name}"

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_JOB_STATES

    def check_transition(self, target: str) -> None:
        check_transition("job", JOB_TRANSITIONS, self.state, target)


class JobTransition(models.Model):
    """One state change of a job, with its typed reason and who caused it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="transitions")
    from_state = models.CharField(max_length=24, blank=True, default="")
    to_state = models.CharField(max_length=24)
    reason = models.CharField(max_length=32, choices=JobReason.choices)
    detail = models.TextField(blank=True, default="")
    actor = models.CharField(max_length=200)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.job_id}: {self.from_state or '∅'} -> {self.to_state} ({self.reason})"


class WorkerGroup(models.Model):
    """A HyperNode: one component's workers within a job."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="groups")
    name = models.CharField(max_length=64)
    kind = models.CharField(max_length=16, help_text="rollout, inference, reward, tool or actor")
    scaling = models.CharField(max_length=16)
    interruptibility = models.CharField(max_length=16)
    tp = models.PositiveIntegerField(default=1)
    pp = models.PositiveIntegerField(default=1)
    valid_dp = models.JSONField(default=list, blank=True)
    min_workers = models.PositiveIntegerField(default=1)
    max_workers = models.PositiveIntegerField(null=True, blank=True)
    hardware = models.JSONField(default=list, blank=True, help_text="hardware affinity, best first")
    depends_on = models.JSONField(default=list, blank=True)
    initial_workers = models.PositiveIntegerField(default=0)
    flagged = models.BooleanField(default=False)
    flag_reason = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["job", "id"]
        constraints: ClassVar = [
            models.UniqueConstraint(fields=["job", "name"], name="group_unique_name_per_job")
        ]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.name}"

    @property
    def gpus_per_worker(self) -> int:
        return self.tp * self.pp


class WorkerState(models.TextChoices):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


WORKER_TRANSITIONS: dict[str, frozenset[str]] = {
    WorkerState.STARTING: frozenset({WorkerState.RUNNING, WorkerState.STOPPING, WorkerState.FAILED}),
    WorkerState.RUNNING: frozenset({WorkerState.STOPPING, WorkerState.FAILED}),
    WorkerState.STOPPING: frozenset({WorkerState.STOPPED, WorkerState.FAILED}),
    WorkerState.STOPPED: frozenset(),
    WorkerState.FAILED: frozenset(),
}
LIVE_WORKER_STATES = frozenset({WorkerState.STARTING, WorkerState.RUNNING})
# Workers that hold devices now or are about to; stopped ones no longer hold or share a device.
CURRENT_WORKER_STATES = (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.STOPPING)


class Worker(models.Model):
    """One worker (engine replica or trainer DP rank group); its devices point at it."""

    group = models.ForeignKey(WorkerGroup, on_delete=models.CASCADE, related_name="workers")
    name = models.CharField(max_length=128, unique=True, help_text="cluster-wide id, e.g. j12-actor-w3")
    state = models.CharField(max_length=16, choices=WorkerState.choices, default=WorkerState.STARTING)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    utilisation = models.FloatField(default=0.0)
    # Colocated groups (verl-style time-sharing) use devices another worker of the job owns.
    colocated_devices = models.ManyToManyField("cluster.Device", blank=True, related_name="colocated_workers")

    class Meta:
        ordering = ["group", "id"]
        indexes = [models.Index(fields=["group", "state"])]

    def __str__(self) -> str:
        return self.name

    def check_transition(self, target: str) -> None:
        check_transition("worker", WORKER_TRANSITIONS, self.state, target)


class IterationResult(models.Model):
    """What one iteration of a job that really runs (the ``ray`` backend) measured, as its driver
    reported it: mean reward and accuracy, response lengths, tokens, and the time of each phase."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="iteration_results")
    iteration = models.PositiveIntegerField()
    mean_reward = models.FloatField(help_text="mean reward of the iteration's samples")
    metrics = models.JSONField(help_text="the driver's report of the iteration, as it sent it")
    node = models.CharField(max_length=200, help_text="the node whose agent reported it first")
    recorded_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "iteration"]
        constraints = [models.UniqueConstraint(fields=["job", "iteration"], name="iteration_result_once")]

    def __str__(self) -> str:
        return f"{self.job_id}#{self.iteration}: reward {self.mean_reward:.3f}"
