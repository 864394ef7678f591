"""One tick of the scheduling loop for one job.

Claims the job under a row lock (SKIP LOCKED: two workers never tick one job at once), builds
the hypergraph and signals, drives an in-flight migration or runs the job's policy, and persists
the decision, the migration and a snapshot — all in one transaction, so a worker killed mid-tick
leaves nothing half-written and the next tick simply starts over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

import scheduler.telemetry as telemetry
from cluster.selectors import free_devices
from common import audit, events
from common.audit import Actor
from jobs import services
from jobs.admission import admit_pending
from jobs.models import Job, JobReason, JobState
from jobs.states import transition
from scheduler.core.decisions import Decision
from scheduler.core.hypergraph import ComponentKind, Hypergraph
from scheduler.core.migration import PlanError
from scheduler.core.policies import build_policy
from scheduler.core.policies.serial import DroppedDecision, SerialDriver
from scheduler.core.predictor import ThroughputPredictor
from scheduler.core.signal_window import SignalAggregator
from scheduler.core.signals import GroupSignals
from scheduler.models import TICK_NOTE_CHARS, GroupSignalsRecord, SchedulingDecision, Tick
from scheduler.selectors import latest_measured_iteration
from scheduler.services import gpu_migrations, placement_changes, predictor_errors, snapshots
from scheduler.services.graph import build_hypergraph, core_device

log = logging.getLogger(__name__)

OBSERVATIONS_KEPT = 64  # per group, in the job's policy_state, to refit the predictor each tick


def due_job_ids(now: Any = None) -> list[int]:
    """Jobs whose next tick is due (running or paused: a paused job still drives its migrations)."""
    now = now or timezone.now()
    ids = []
    for job_id, tick_seconds, last in Job.objects.filter(
        state__in=(JobState.RUNNING, JobState.PAUSED_SCHEDULING)
    ).values_list("pk", "tick_seconds", "last_tick_at"):
        if last is None or now - last >= timedelta(seconds=tick_seconds * 0.9):
            ids.append(job_id)
    return ids


def run_tick(job_id: int) -> Tick | None:
    """Tick one job; None when another worker holds it or it is not running."""
    started = time.perf_counter()
    with transaction.atomic():
        # NO KEY UPDATE: two ticks still exclude each other, but rows other transactions insert
        # that point at the job (audit events, step reports) need not wait for the tick to end.
        job = (
            Job.objects.select_for_update(skip_locked=True, no_key=True)
            .filter(pk=job_id, state__in=(JobState.RUNNING, JobState.PAUSED_SCHEDULING))
            .first()
        )
        if job is None:
            return None
        now = timezone.now()
        if job.last_tick_at and now - job.last_tick_at < timedelta(seconds=job.tick_seconds * 0.5):
            return None  # a duplicate delivery of the same beat
        tick = Tick.objects.create(job=job, started_at=now, outcome="running")
        graph = build_hypergraph(job, taken_at=now.timestamp())
        signals = compute_signals(job, graph, now.timestamp())
        graph = build_hypergraph(job, signals=signals, taken_at=now.timestamp())
        _store_signals(job, signals, now)
        policy_ms = 0.0
        decisions = 0

        in_flight = gpu_migrations.open_migration(job)
        replacing = placement_changes.open_change(job) if in_flight is None else None
        if in_flight is not None:
            # A step report holds the migration's lock and then needs the job's: never wait for it
            # while holding the job (that order deadlocks). The report drives the migration itself.
            migration = (
                type(in_flight).objects.select_for_update(skip_locked=True).filter(pk=in_flight.pk).first()
            )
            if migration is not None:
                gpu_migrations.fail_stuck_steps(migration, now=now)
                gpu_migrations.advance(migration)
            outcome = "migration_in_flight"
        elif replacing is not None:
            # The job's workers are stopping or starting in their new layout: nothing to decide.
            placement_changes.fail_if_stuck(replacing, now=now)
            outcome = "replacing"
        elif _iterations_done(job, signals):
            outcome = "finished"
        elif job.state == JobState.PAUSED_SCHEDULING:
            outcome = "paused"
        else:
            policy_started = time.perf_counter()
            predictor = _predictor(job, graph, signals, now.timestamp())
            policy = build_policy(
                job.policy,
                predictor=predictor,
                cost_model=gpu_migrations.cost_model_for(job),
                params=job.spec.get("policy", {}).get("params", {}),
            )
            policy.load_state(job.policy_state.get("policy", {}))
            # Only a boundary learns from the driver's measurement: read it on those ticks alone.
            if policy.iteration_advanced(graph) and (measured := latest_measured_iteration(job)) is not None:
                policy.observe_iteration(measured)
            driver = SerialDriver(
                policy,
                SerialDriver.queued_from_json(job.policy_state.get("queued", [])),
                placement_changes=True,
            )
            free = [core_device(d) for d in free_devices(job.backend)]
            decision = driver.next_decision(graph, signals, free, now.timestamp())
            policy_ms = (time.perf_counter() - policy_started) * 1000
            outcome = "no_change"
            if driver.placement_change is not None:
                replaced = placement_changes.start(job, driver.placement_change, actor=Actor.scheduler())
                if isinstance(replaced, str):
                    policy.placement_refused(driver.placement_change, replaced)
                else:
                    driver.queued.clear()  # the job is laid out anew: no move of the old layout applies
                    outcome = "replacing"
            for dropped in driver.dropped:
                _record_dropped(job, dropped)
            if driver.iteration_ended and policy.replan_note:
                _record_replan(job, policy.replan_note)
            if decision is not None:
                refused = _start(job, tick, decision, graph, signals)
                if refused is None:
                    decisions += 1
                    outcome = "decided"
                else:
                    policy.decision_refused(decision, refused)
            if outcome == "no_change":
                tick.note = policy.idle_note[:TICK_NOTE_CHARS]
            job.policy_state["policy"] = policy.state_to_json()
            job.policy_state["queued"] = driver.queued_to_json()

        predictor_errors.settle(job, signals, now)
        snapshots.take(job, cause="change", graph=graph, signals=signals, force=False)
        job.last_tick_at = now
        job.save(update_fields=["last_tick_at", "policy_state", "tokens_per_s"])
        tick.duration_ms = (time.perf_counter() - started) * 1000
        tick.policy_ms = policy_ms
        tick.outcome = outcome
        tick.decision_count = decisions
        tick.save(update_fields=["duration_ms", "policy_ms", "outcome", "decision_count", "note"])
        if outcome == "finished":
            _complete(job)
        return tick


def compute_signals(job: Job, graph: Hypergraph, now: float) -> dict[str, GroupSignals]:
    u_low = float(job.spec.get("policy", {}).get("params", {}).get("u_low", 0.2))
    aggregator = SignalAggregator(window_s=settings.SIGNAL_WINDOW_S, u_low=u_low)
    aggregator.add_many(telemetry.recent_samples(job.pk, now - settings.SIGNAL_WINDOW_S))
    max_running = {
        c["name"]: int(c.get("max_running_requests", 0))
        for c in job.spec.get("components", [])
        if isinstance(c, dict)
    }
    signals = aggregator.all_signals(graph, now, max_in_flight_per_worker=max_running)
    job.tokens_per_s = job_tokens_per_s(graph, signals)
    return signals


def job_tokens_per_s(graph: Hypergraph, signals: Mapping[str, GroupSignals]) -> float:
    """The job's useful throughput: tokens the trainer consumes (generated tokens without one)."""
    actors = [signals[n.id].tokens_per_s for n in graph.by_kind(ComponentKind.ACTOR) if n.id in signals]
    if actors:
        return sum(actors)
    return sum(signals[n.id].tokens_per_s for n in graph.by_kind(ComponentKind.ROLLOUT) if n.id in signals)


def _store_signals(job: Job, signals: Mapping[str, GroupSignals], now: Any) -> None:
    for group in job.groups.all():
        if group.name in signals:
            GroupSignalsRecord.objects.update_or_create(
                group=group, defaults={"computed_at": now, "data": signals[group.name].to_json()}
            )


def _predictor(
    job: Job, graph: Hypergraph, signals: Mapping[str, GroupSignals], now: float
) -> ThroughputPredictor:
    """Refit from the observations this job has made so far, plus this tick's."""
    kept: dict[str, list[list[float]]] = job.policy_state.setdefault("observations", {})
    for node in graph.nodes:
        s = signals.get(node.id)
        if s is not None and s.busy and s.tokens_per_s > 0 and node.gpus > 0:
            rows = kept.setdefault(node.id, [])
            rows.append([float(node.gpus), s.tokens_per_s, now])
            del rows[:-OBSERVATIONS_KEPT]
    predictor = ThroughputPredictor(job.spec.get("profiles") or None)
    kinds = {n.id: n.kind for n in graph.nodes}
    for group_id, rows in kept.items():
        if group_id in kinds:
            for gpus, rate, at in rows:
                predictor.observe(group_id, kinds[group_id], gpus, rate, at)
    return predictor


def _start(
    job: Job, tick: Tick, decision: Decision, graph: Hypergraph, signals: Mapping[str, GroupSignals]
) -> str | None:
    """Record ``decision`` and plan its migration; None when planned, else why the planner
    refused it (the decision row says so too)."""
    decision_row = SchedulingDecision.objects.create(
        job=job,
        tick=tick,
        policy=decision.policy,
        reason=decision.reason.value,
        detail=decision.detail,
        donor=decision.donor or "",
        recipient=decision.recipient or "",
        device_uids=list(decision.device_ids),
        inputs={gid: s.to_json() for gid, s in signals.items()},
        candidates=[c.to_json() for c in decision.candidates],
        chosen=decision.to_json(),
    )
    audit.record(Actor.scheduler(), "decision", decision_row, job=job, reason=decision.detail)
    events.publish(
        "decision",
        {
            "id": decision_row.pk,
            "reason": decision_row.reason,
            "detail": decision_row.detail,
            "donor": decision_row.donor,
            "recipient": decision_row.recipient,
            "devices": decision_row.device_uids,
        },
        job_id=job.pk,
    )
    try:
        with transaction.atomic():
            gpu_migrations.create_migration(job, decision_row, decision, graph, actor=Actor.scheduler())
    except PlanError as exc:
        # The policy proposed something the planner refuses: keep the decision, say why.
        decision_row.detail = f"{decision_row.detail} [not carried out: {exc}]"
        decision_row.save(update_fields=["detail"])
        log.warning("job %s: decision %s not planned: %s", job.pk, decision_row.pk, exc)
        return str(exc)
    return None


def _record_dropped(job: Job, dropped: DroppedDecision) -> None:
    """A queued move that no longer fits: said in the audit trail, since no decision row exists."""
    decision = dropped.decision
    log.info("job %s: queued %s move dropped: %s", job.pk, decision.reason.value, dropped.why)
    audit.record(
        Actor.scheduler(),
        "decision_dropped",
        job,
        job=job,
        reason=f"{decision.detail} [dropped: {dropped.why}]",
        payload={"decision": decision.to_json(), "why": dropped.why},
    )


def _record_replan(job: Job, note: str) -> None:
    """What the policy measured of the iteration that ended and what it concluded for the next
    (placement kept or recommended, base split), as one audit row per boundary."""
    audit.record(Actor.scheduler(), "replan", job, job=job, reason=note, payload={"iteration": job.iteration})


def _iterations_done(job: Job, signals: Mapping[str, GroupSignals]) -> bool:
    return job.iteration >= job.iterations_total


def _complete(job: Job) -> None:
    with transaction.atomic():
        locked = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
        if locked.is_terminal:
            return
        transition(
            locked,
            JobState.SUCCEEDED,
            JobReason.ITERATIONS_COMPLETE,
            Actor.scheduler(),
            f"{locked.iteration} iterations",
        )
        services.release_workers(locked, reason="job finished")
    admit_pending(actor=Actor.scheduler())
