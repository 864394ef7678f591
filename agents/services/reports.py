"""Reports: an agent's outcome of one command (addressed by command id, or for a migration step by
step id and attempt). A launch report moves starting workers to running (the job too, once all
run) or failed (the job fails); a stop report stops workers and frees their devices; a step report
goes to the migration engine.

Every report runs in one transaction with its AuditEvent; a report for a finished command changes
nothing and answers with the recorded outcome. Lock order, the same as the rest of the control
plane: job, then command, then workers and devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from agents.services import progress
from agents.services.command_states import FINISHED_COMMAND_STATES, check_command
from agents.services.payloads import InvalidPayload, json_object, text_field
from cluster.models import AgentCommand, CommandState, Device, Node, release_devices
from common import audit
from common.audit import Actor
from jobs import services as job_services
from jobs.admission import admit_pending
from jobs.models import LIVE_WORKER_STATES, Job, JobReason, JobState, Worker, WorkerState
from jobs.states import transition
from scheduler.models import MigrationStep
from scheduler.services import gpu_migrations, placement_changes
from scheduler.services.gpu_migrations import StepNotForNode, StepNotFound
from scheduler.telemetry import FieldError


class CommandNotFound(Exception):
    pass


class NotYourCommand(Exception):
    """A node reported (or asked about) a command queued for another node."""


@dataclass(frozen=True)
class Report:
    ok: bool
    error: str
    result: dict[str, Any]
    workers: dict[str, dict[str, Any]]  # per-worker outcome of launch/stop commands, when given


def parse_report(payload: Any) -> Report:
    data = json_object(payload)
    errors: list[FieldError] = []
    ok = data.get("ok")
    if not isinstance(ok, bool):
        errors.append(FieldError("ok", "must be true or false"))
    error = text_field(data, "error", errors, max_length=10_000, default="")
    result = data.get("result", {})
    if not isinstance(result, Mapping):
        errors.append(FieldError("result", "must be an object"))
        result = {}
    workers: dict[str, dict[str, Any]] = {}
    raw_workers = data.get("workers", {})
    if not isinstance(raw_workers, Mapping):
        errors.append(FieldError("workers", "must be an object mapping worker names to outcomes"))
        raw_workers = {}
    for name, outcome in raw_workers.items():
        path = f"workers.{name}"
        if not isinstance(outcome, Mapping) or not isinstance(outcome.get("ok"), bool):
            errors.append(FieldError(f"{path}.ok", "must be true or false"))
            continue
        detail = outcome.get("error", "")
        if not isinstance(detail, str):
            errors.append(FieldError(f"{path}.error", "must be a string"))
            detail = ""
        workers[name] = {"ok": outcome["ok"], "error": detail}
    if errors:
        raise InvalidPayload(errors)
    return Report(ok=bool(ok), error=error, result=dict(result), workers=workers)


@dataclass
class ReportOutcome:
    command: AgentCommand
    repeated: bool


def report_command(node: Node, command_id: str, payload: Any) -> ReportOutcome:
    """An agent's outcome of one command. Idempotent: a command already finished keeps its
    recorded outcome and the report changes nothing."""
    report = parse_report(payload)
    command = AgentCommand.objects.filter(command_id=command_id).first()
    if command is None:
        raise CommandNotFound(command_id)
    if command.node_id != node.pk:
        raise NotYourCommand(f"command {command_id} is not for node {node.name}")
    if command.state in FINISHED_COMMAND_STATES:
        return ReportOutcome(command, repeated=True)
    if command.kind == "migration_step":
        return _report_step(node, command, report)
    if command.kind in ("launch_workers", "stop_workers"):
        return _report_workers(node, command, report)
    return _report_plain(node, command, report)


def report_step(node: Node, step_id: str, attempt: int | None, payload: Any) -> ReportOutcome:
    """A migration step's outcome, addressed by step id (and attempt): the same as reporting the
    node's command for that step."""
    step = MigrationStep.objects.filter(step_id=step_id).first()
    if step is None:
        raise StepNotFound(step_id)
    commands = AgentCommand.objects.filter(step=step, kind="migration_step")
    if not commands.filter(node=node).exists():
        raise StepNotForNode(f"step {step_id} does not run on {node.name}")
    mine = commands.filter(node=node).order_by("-created_at", "-id")
    if attempt is not None:
        mine = mine.filter(payload__attempt=attempt)
    command = mine.first()
    if command is None:
        raise StepNotFound(f"{step_id} attempt {attempt}")
    return report_command(node, command.command_id, payload)


def _finish(command: AgentCommand, ok: bool, result: dict[str, Any]) -> None:
    target = CommandState.DONE if ok else CommandState.FAILED
    check_command(command, target)
    command.state = target
    command.finished_at = timezone.now()
    command.result = result
    command.save(update_fields=["state", "finished_at", "result"])


def _locked_command(pk: int) -> AgentCommand:
    return AgentCommand.objects.select_for_update().get(pk=pk)


def _job(command: AgentCommand) -> Job | None:
    job_id = command.payload.get("job")
    return Job.objects.filter(pk=job_id).first() if isinstance(job_id, int) else None


def _audit_report(node: Node, command: AgentCommand, report: Report, job: Job | None) -> None:
    audit.record(
        Actor.for_agent(node.name),
        "agent.command.report",
        command,
        job=job,
        reason=report.error,
        payload={"kind": command.kind, "ok": report.ok, "state": command.state},
    )


def _report_plain(node: Node, command: AgentCommand, report: Report) -> ReportOutcome:
    with transaction.atomic():
        command = _locked_command(command.pk)
        if command.state in FINISHED_COMMAND_STATES:
            return ReportOutcome(command, repeated=True)
        _finish(command, report.ok, {"ok": report.ok, "error": report.error, "result": report.result})
        _audit_report(node, command, report, _job(command))
    return ReportOutcome(command, repeated=False)


def _report_step(node: Node, command: AgentCommand, report: Report) -> ReportOutcome:
    with transaction.atomic():
        command = _locked_command(command.pk)
        if command.state in FINISHED_COMMAND_STATES:
            return ReportOutcome(command, repeated=True)
        step = command.payload.get("step", {})
        gpu_migrations.report_step(
            node,
            step.get("step_id", ""),
            ok=report.ok,
            error=report.error,
            result=report.result,
            attempt=command.payload.get("attempt"),
        )
        command.refresh_from_db()
        if command.state not in FINISHED_COMMAND_STATES:
            # A report for an attempt the migration has moved past: recorded, but it steers nothing.
            _finish(command, report.ok, {"ok": report.ok, "error": report.error, "result": report.result})
        _audit_report(node, command, report, _job(command))
    return ReportOutcome(command, repeated=False)


def _report_workers(node: Node, command: AgentCommand, report: Report) -> ReportOutcome:
    """launch_workers: starting workers run (the job runs once all do) or fail (the job fails);
    stop_workers: stopping workers stop and their devices are freed. Freed devices go to
    waiting jobs afterwards."""
    actor = Actor.for_agent(node.name)
    freed = False
    with transaction.atomic():
        job_id = command.payload.get("job")
        job = (
            Job.objects.select_for_update(no_key=True).filter(pk=job_id).first()
            if isinstance(job_id, int)
            else None
        )
        command = _locked_command(command.pk)
        if command.state in FINISHED_COMMAND_STATES:
            return ReportOutcome(command, repeated=True)
        names = [
            w["worker"] if isinstance(w, Mapping) else str(w) for w in command.payload.get("workers", [])
        ]
        outcomes = {
            name: report.workers.get(name, {"ok": report.ok, "error": report.error if not report.ok else ""})
            for name in names
        }
        workers = list(Worker.objects.select_for_update().filter(name__in=names).order_by("pk"))
        if command.kind == "launch_workers":
            failed = _apply_launch(workers, outcomes)
            freed = bool(failed)
        else:
            failed = []
            freed = _apply_stop(workers, outcomes)
        all_ok = all(o["ok"] for o in outcomes.values())
        _finish(
            command,
            all_ok,
            {"ok": all_ok, "error": report.error, "result": report.result, "workers": outcomes},
        )
        _audit_report(node, command, report, job)
        if job is not None and not job.is_terminal:
            if failed:
                detail = "; ".join(f"{w}: {outcomes[w]['error'] or 'failed to start'}" for w in failed)
                transition(job, JobState.FAILED, JobReason.WORKER_FAILED, actor, detail)
                job_services.release_workers(job, reason="a worker of the job failed to start")
            elif (
                command.kind == "launch_workers"
                and job.state == JobState.ADMITTED
                and not Worker.objects.filter(group__job=job, state=WorkerState.STARTING).exists()
            ):
                transition(job, JobState.RUNNING, JobReason.WORKERS_LAUNCHED, actor)
        if job is not None:
            # A job being placed anew waits for exactly these reports to go on.
            if command.kind == "launch_workers":
                placement_changes.on_workers_launched(job)
            elif (launched := placement_changes.on_workers_stopped(job)) is not None:
                progress.redo_from(job, launched.iteration)
    if freed:
        admit_pending(actor=actor)
    return ReportOutcome(command, repeated=False)


def _apply_launch(workers: list[Worker], outcomes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Starting workers run or fail; returns the names that failed. Workers that moved on meanwhile
    (e.g. stopping because the job was cancelled) are left alone."""
    now = timezone.now()
    failed = []
    for worker in workers:
        if worker.state != WorkerState.STARTING:
            continue
        if outcomes[worker.name]["ok"]:
            worker.check_transition(WorkerState.RUNNING)
            worker.state, worker.started_at = WorkerState.RUNNING, now
            worker.save(update_fields=["state", "started_at"])
        else:
            worker.check_transition(WorkerState.FAILED)
            worker.state, worker.stopped_at = WorkerState.FAILED, now
            worker.save(update_fields=["state", "stopped_at"])
            release_devices(Device.objects.filter(worker=worker))
            failed.append(worker.name)
    return failed


def _apply_stop(workers: list[Worker], outcomes: Mapping[str, Mapping[str, Any]]) -> bool:
    """Stopped workers release their devices; returns whether any device was freed. A worker the
    agent could not stop keeps its devices (they may still be busy) and stays stopping."""
    now = timezone.now()
    freed = False
    for worker in workers:
        if not outcomes[worker.name]["ok"] or worker.state in (WorkerState.STOPPED, WorkerState.FAILED):
            continue
        if worker.state in LIVE_WORKER_STATES:
            worker.check_transition(WorkerState.STOPPING)
            worker.state = WorkerState.STOPPING
        worker.check_transition(WorkerState.STOPPED)
        worker.state, worker.stopped_at = WorkerState.STOPPED, now
        worker.save(update_fields=["state", "stopped_at"])
        freed = release_devices(Device.objects.filter(worker=worker)) > 0 or freed
    return freed
