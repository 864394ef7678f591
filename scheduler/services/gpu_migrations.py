"""Driving migrations: plan -> steps as rows -> agent commands -> reports -> commit or roll back.

A Migration row holds the core's plan and the PlanExecution state; each step is a MigrationStep
row, dispatched as one AgentCommand per node that executes it. Reports are idempotent (per step,
attempt and node). Device ownership changes only when the migration finishes, in one transaction,
and only for the sides that passed their point of no return, so a group is never half-switched.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from cluster.models import (
    AgentCommand,
    CommandState,
    Device,
    DevicesNoLongerFree,
    DeviceStatus,
    Node,
    NodeStatus,
    end_reservations,
    release_devices,
    reserve_devices,
)
from common import audit, events
from common.audit import Actor
from jobs.models import Job, JobState, Worker, WorkerGroup, WorkerState
from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Decision, Reason
from scheduler.core.hypergraph import ComponentKind, Hypergraph
from scheduler.core.migration import (
    MigrationPlan,
    PlanError,
    PlanExecution,
    PlannedStep,
    StepKind,
    plan_migration,
)
from scheduler.core.migration import StepState as CoreStepState
from scheduler.models import (
    OPEN_MIGRATION_STATES,
    Migration,
    MigrationState,
    MigrationStep,
    SchedulingDecision,
    StepState,
)
from scheduler.services import placement_changes, snapshots
from scheduler.services.graph import build_hypergraph

log = logging.getLogger(__name__)


class ManualMigrationError(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class StepNotFound(Exception):
    pass


class StepNotForNode(Exception):
    pass


CALIBRATION_MIGRATIONS = 8  # a job's latest committed migrations that calibrate its cost model
MEASURED_SCALE_BOUNDS = (0.25, 100.0)
CALIBRATION_WORKER_STARTS = 16  # a job's latest engine starts that say what one takes here
SERVING_KINDS = (ComponentKind.ROLLOUT.value, ComponentKind.INFERENCE.value)


def modelled_costs(job: Job) -> MigrationCostModel:
    """The cost model from the job's model size alone: what plans and their estimates use, so a
    migration's ``estimated_s`` stays comparable with what it then took."""
    params_b = float(job.spec.get("model", {}).get("params_b", 7.0))
    return MigrationCostModel(model_params_b=params_b)


def cost_model_for(job: Job) -> MigrationCostModel:
    """What the job's policy weighs moves with: the modelled costs scaled by how long the job's
    own latest committed migrations took against their estimates (the median ratio), so a policy
    on a deployment slower than the model stops paying for moves that do not pay back."""
    modelled = modelled_costs(job)
    ratios = [
        (finished - created).total_seconds() / estimated
        for created, finished, estimated in Migration.objects.filter(
            job=job, state=MigrationState.COMMITTED, finished_at__isnull=False, estimated_s__gt=0
        )
        .order_by("-finished_at")
        .values_list("created_at", "finished_at", "estimated_s")[:CALIBRATION_MIGRATIONS]
        if finished is not None
    ]
    started = worker_start_s(job)
    if started is not None:
        modelled = replace(modelled, worker_start_measured_s=started)
    if not ratios:
        return modelled
    low, high = MEASURED_SCALE_BOUNDS
    return replace(modelled, measured_scale=min(high, max(low, statistics.median(ratios))))


def worker_start_s(job: Job) -> float | None:
    """The median seconds the job's serving workers (engines) took from being placed to running,
    over its latest starts; None before one has started."""
    spans = [
        (started - created).total_seconds()
        for created, started in Worker.objects.filter(
            group__job=job, group__kind__in=SERVING_KINDS, started_at__isnull=False
        )
        .order_by("-started_at")
        .values_list("created_at", "started_at")[:CALIBRATION_WORKER_STARTS]
        if started is not None
    ]
    return statistics.median(spans) if spans else None


def open_migration(job: Job) -> Migration | None:
    return Migration.objects.filter(job=job, state__in=OPEN_MIGRATION_STATES).order_by("created_at").first()


# Steps after which the listed workers no longer run on their agents, though the database lists
# them live until the migration finishes.
RELEASING_KINDS = (StepKind.STOP_WORKERS, StepKind.RELEASE_DEVICES, StepKind.DESTROY_OLD)


def workers_released_in_flight() -> set[str]:
    """Workers an open migration has stopped or released on their agents, or may have (the step
    is issued and not answered yet: its agent may have died after stopping them), and not started
    again by a compensation. A restarted agent neither launches them again nor takes their
    missing processes for lost ones: the migration's outcome, not the agent, decides what becomes
    of their devices."""
    done = list(
        MigrationStep.objects.filter(
            migration__state__in=OPEN_MIGRATION_STATES,
            is_rollback=False,
            state__in=[StepState.DONE, StepState.RUNNING],
            kind__in=[k.value for k in RELEASING_KINDS],
        ).values_list("migration_id", "index", "worker_names")
    )
    if not done:
        return set()
    restarted = set(
        MigrationStep.objects.filter(
            migration_id__in={m for m, _, _ in done}, is_rollback=True, state=StepState.DONE
        ).values_list("migration_id", "index")
    )
    # A compensation's row is numbered 1000 after the step it undoes.
    return {w for m, index, names in done if (m, 1000 + index) not in restarted for w in names}


def workers_switched_in_flight(node: Node) -> list[dict[str, Any]]:
    """New workers on ``node`` of open migrations whose side has passed its switch: they run and
    belong to their group (the membership changed at the switch), though their rows are created
    only at the commit. A restarted agent launches them again like any running worker, in the
    registration reply's shape."""
    found: list[dict[str, Any]] = []
    for migration in Migration.objects.filter(state__in=OPEN_MIGRATION_STATES).order_by("pk"):
        plan, execution = _load(migration)
        for step in plan.steps:
            if step.kind is not StepKind.START_WORKERS or not _past_point_of_no_return(
                plan, execution, step.group_id
            ):
                continue
            group = WorkerGroup.objects.get(job_id=migration.job_id, name=step.group_id)
            devices = {d.uid: d for d in Device.objects.filter(uid__in=step.device_ids, node=node)}
            for worker, device_uids in step.devices_by_worker().items():
                if any(uid in devices for uid in device_uids):
                    found.append(
                        {
                            "worker": worker,
                            "job": migration.job_id,
                            "group": group.name,
                            "kind": group.kind,
                            "state": WorkerState.RUNNING,
                            "devices": [
                                {"uid": d.uid, "index": d.index, "hardware": d.hardware}
                                for d in sorted(
                                    (devices[u] for u in device_uids if u in devices), key=lambda d: d.index
                                )
                            ],
                            "tp": group.tp,
                            "pp": group.pp,
                        }
                    )
    return found


def _past_point_of_no_return(
    plan: MigrationPlan, execution: PlanExecution, group: str, *, before: int | None = None
) -> bool:
    """``group``'s side passed its point of no return (before step index ``before``, if given): it
    can only roll forward."""
    return any(
        s.point_of_no_return
        and s.group_id == group
        and (before is None or s.index < before)
        and execution.step_state(s.step_id) is CoreStepState.DONE
        for s in plan.steps
    )


# --- creating ----------------------------------------------------------------------------------


def create_migration(
    job: Job, decision_row: SchedulingDecision, decision: Decision, graph: Hypergraph, *, actor: Actor
) -> Migration:
    """Plan ``decision`` and start it. The caller holds the job's row lock. Raises PlanError."""
    migration_id = f"m{job.pk}-{decision_row.pk}"
    plan = plan_migration(decision, graph, modelled_costs(job), migration_id=migration_id)
    # Devices from the free pool are reserved now and handed out only at the commit, so neither
    # admission nor another job's tick can take them meanwhile.
    owned = set(
        Device.objects.filter(uid__in=decision.device_ids, worker__isnull=False).values_list("uid", flat=True)
    )
    try:
        reserve_devices([u for u in decision.device_ids if u not in owned], migration_id=migration_id)
    except DevicesNoLongerFree as exc:
        raise PlanError(str(exc)) from exc
    strategies = "+".join(s for s in (decision.donor_strategy, decision.recipient_strategy) if s)
    migration = Migration.objects.create(
        migration_id=migration_id,
        job=job,
        decision=decision_row,
        donor=decision.donor or "",
        recipient=decision.recipient or "",
        strategy=strategies,
        device_uids=list(decision.device_ids),
        plan=plan.to_json(),
        execution=PlanExecution(plan).to_json(),
        estimated_s=plan.estimated_s,
        requested_by=actor.label,
    )
    device_nodes = dict(Device.objects.filter(uid__in=_all_device_ids(plan)).values_list("uid", "node__name"))
    worker_nodes = _worker_nodes(job)
    for step in plan.steps:
        MigrationStep.objects.create(
            migration=migration,
            step_id=step.step_id,
            index=step.index,
            kind=step.kind.value,
            group=step.group_id,
            nodes=_step_nodes(step, device_nodes, worker_nodes),
            device_uids=list(step.device_ids),
            worker_names=list(step.worker_ids),
            point_of_no_return=step.point_of_no_return,
            estimated_s=step.estimated_s,
        )
    audit.record(
        actor,
        "migration.plan",
        migration,
        job=job,
        reason=decision.detail,
        payload={
            "donor": migration.donor,
            "recipient": migration.recipient,
            "devices": migration.device_uids,
        },
    )
    events.publish("migration", migration_event(migration), job_id=job.pk)
    advance(migration)
    return migration


def _all_device_ids(plan: MigrationPlan) -> set[str]:
    return {d for step in plan.steps for d in step.device_ids}


def _worker_nodes(job: Job) -> dict[str, set[str]]:
    """worker name -> nodes of its devices, and group name -> nodes of all its workers."""
    result: dict[str, set[str]] = {}
    for worker_name, group_name, node_name in Device.objects.filter(worker__group__job=job).values_list(
        "worker__name", "worker__group__name", "node__name"
    ):
        result.setdefault(worker_name, set()).add(node_name)
        result.setdefault(f"group:{group_name}", set()).add(node_name)
    return result


def _step_nodes(
    step: PlannedStep, device_nodes: Mapping[str, str], worker_nodes: Mapping[str, set[str]]
) -> list[str]:
    nodes = {device_nodes[d] for d in step.device_ids if d in device_nodes}
    for worker in step.worker_ids:
        nodes |= worker_nodes.get(worker, set())
    if not nodes:
        # Group-wide steps with nothing listed (e.g. dropping old process groups) run where the group runs.
        nodes = set(worker_nodes.get(f"group:{step.group_id}", set()))
    return sorted(nodes)


# --- advancing ---------------------------------------------------------------------------------


def _load(migration: Migration) -> tuple[MigrationPlan, PlanExecution]:
    plan = MigrationPlan.from_json(migration.plan)
    return plan, PlanExecution.from_json(plan, migration.execution)


def advance(migration: Migration) -> None:
    """Dispatch the next step, or finish. Caller holds the migration's row lock (or just created it)."""
    plan, execution = _load(migration)
    while True:
        state = execution.state
        if state in ("committed", "rolled_back", "failed"):
            _finish(migration, plan, execution)
            return
        if state == "rolling_back" and migration.state == MigrationState.RUNNING:
            _set_state(migration, MigrationState.ROLLING_BACK)
        step = execution.next_step()
        if step is None:
            break
        row = _step_row(migration, step)
        if row.state == StepState.RUNNING:
            break  # dispatched already; waiting for its reports
        if migration.state == MigrationState.PLANNED:
            migration.started_at = timezone.now()
            _set_state(migration, MigrationState.RUNNING)
        nodes = _reachable_nodes(
            row, rolls_forward=_past_point_of_no_return(plan, execution, step.group_id, before=step.index)
        )
        if nodes is None:
            execution.report(step.step_id, False, "a node this step needs is lost")
            _mark(row, StepState.FAILED, error="a node this step needs is lost", attempts=row.attempts + 1)
            continue
        row.check_transition(StepState.RUNNING)
        row.state = StepState.RUNNING
        row.attempts += 1
        row.started_at = timezone.now()
        row.finished_at = None
        row.save(update_fields=["state", "attempts", "started_at", "finished_at"])
        if not nodes:
            # Nothing left to execute it (its nodes are gone, and so are their workers).
            execution.report(step.step_id, True)
            _mark(row, StepState.DONE)
            continue
        handover = _handover_for(migration, step)
        for node in nodes:
            AgentCommand.objects.create(
                command_id=f"{row.step_id}@{node.name}#{row.attempts}",
                node=node,
                kind="migration_step",
                step=row,
                payload={
                    "migration": migration.migration_id,
                    "job": migration.job_id,
                    "attempt": row.attempts,
                    "is_rollback": row.is_rollback,
                    "step": step.to_json(),
                    "handover": _handover_to(node, handover),
                    # A node new to the job learns what to run from the step itself.
                    **({"spec": migration.job.spec} if step.kind is StepKind.START_WORKERS else {}),
                },
            )
        events.publish("migration.step", step_event(row), job_id=migration.job_id)
        break
    migration.execution = execution.to_json()
    migration.save(update_fields=["execution"])


def _handover_to(node: Node, handover: Mapping[str, Any]) -> dict[str, Any]:
    """A node's part of a handover: only the requests addressed to its workers (a rollout's whole
    queue is megabytes; every node need not receive all of it)."""
    by_node = handover.get("by_node")
    if by_node is None:
        return dict(handover)
    return {"requests": by_node.get(node.name, [])}


def _handover_for(migration: Migration, step: PlannedStep) -> dict[str, Any]:
    """What an earlier step produced for this one: the requests taken back from paused donors go
    to the remaining workers (redistribute) or back to the donors (return, on rollback); those a
    growing group's old members shed go to its new members (redistribute)."""
    if step.kind not in (StepKind.REDISTRIBUTE_REQUESTS, StepKind.RETURN_REQUESTS):
        return {}
    # The producer is the last step before this one on the same side that took requests away.
    take_back = (
        migration.steps.filter(
            kind__in=(StepKind.TAKE_BACK_REQUESTS.value, StepKind.SHED_REQUESTS.value),
            group=step.group_id,
            index__lt=step.index + (1 if step.kind is StepKind.RETURN_REQUESTS else 0),
            is_rollback=False,
        )
        .order_by("-index")
        .first()
    )
    if take_back is None:
        return {"requests": []}
    outcomes = take_back.result.get("attempts", {}).get(str(take_back.attempts), {})
    requests: list[Any] = []
    for node in sorted(outcomes):
        requests.extend(outcomes[node].get("result", {}).get("requests", []))
    if step.kind is StepKind.RETURN_REQUESTS or not step.worker_ids:
        return {"requests": requests}
    # Redistribute: request n goes to the n-th of the step's workers in turn (sorted), named in
    # its "to", and each node is sent only those of its own workers.
    targets = sorted(step.worker_ids)
    devices = step.devices_by_worker()
    node_of_device = dict(Device.objects.filter(uid__in=step.device_ids).values_list("uid", "node__name"))
    node_of = {w: node_of_device.get(devices[w][0], "") if devices.get(w) else "" for w in targets}
    by_node: dict[str, list[Any]] = {}
    for position, request in enumerate(requests):
        target = targets[position % len(targets)]
        addressed = {**request, "to": target} if isinstance(request, Mapping) else request
        by_node.setdefault(node_of[target], []).append(addressed)
    if "" in by_node:  # a worker whose node is unknown: every node gets the whole list, in turn
        return {"requests": requests}
    return {"requests": requests, "by_node": by_node}


def _step_row(migration: Migration, step: PlannedStep) -> MigrationStep:
    row = MigrationStep.objects.filter(step_id=step.step_id).first()
    if row is not None:
        return row
    # A compensation: created when the rollback reaches it. Rollback rows are numbered after the plan.
    original = MigrationStep.objects.get(migration=migration, index=step.index, is_rollback=False)
    return MigrationStep.objects.create(
        migration=migration,
        step_id=step.step_id,
        index=1000 + step.index,
        kind=step.kind.value,
        group=step.group_id,
        nodes=original.nodes,
        device_uids=list(step.device_ids),
        worker_names=list(step.worker_ids),
        is_rollback=True,
        estimated_s=step.estimated_s,
    )


def _reachable_nodes(row: MigrationStep, *, rolls_forward: bool) -> list[Node] | None:
    """The ready nodes that must run the step; None when a forward step needs a lost node.
    A compensation skips lost nodes: what it would undo died with them. So does a step of a side
    past its point of no return: what it would stop or drop there (old process groups, released
    workers) died with the node, and the side must go through."""
    nodes = list(Node.objects.filter(name__in=row.nodes))
    lost = [n for n in nodes if n.status == NodeStatus.LOST]
    if lost and not (row.is_rollback or rolls_forward):
        return None
    return [n for n in nodes if n.status != NodeStatus.LOST]


def _mark(row: MigrationStep, state: StepState, *, error: str = "", attempts: int | None = None) -> None:
    if row.state != state:
        if row.state == StepState.PLANNED and state in (StepState.DONE, StepState.FAILED):
            row.state = StepState.RUNNING  # it ran in the control plane, instantly
        row.check_transition(state)
    row.state = state
    row.error = error
    if attempts is not None:
        row.attempts = attempts
    row.finished_at = timezone.now()
    row.save(update_fields=["state", "error", "attempts", "finished_at", "started_at"])
    events.publish("migration.step", step_event(row), job_id=row.migration.job_id)


def _set_state(migration: Migration, state: MigrationState) -> None:
    migration.check_transition(state)
    migration.state = state
    migration.save(update_fields=["state", "started_at"])


# --- reports -----------------------------------------------------------------------------------


def report_step(
    node: Node,
    step_id: str,
    *,
    ok: bool,
    error: str = "",
    result: Mapping[str, Any] | None = None,
    attempt: int | None = None,
) -> MigrationStep:
    """An agent's outcome for its part of a step. A repeated or stale report changes nothing."""
    with transaction.atomic():
        found = MigrationStep.objects.filter(step_id=step_id).values_list("migration_id", flat=True).first()
        if found is None:
            raise StepNotFound(step_id)
        migration = Migration.objects.select_for_update().get(pk=found)  # lock order: migration, then step
        row = MigrationStep.objects.select_for_update().get(step_id=step_id)
        if node.name not in row.nodes:
            raise StepNotForNode(f"step {step_id} does not run on {node.name}")
        if attempt is not None and attempt != row.attempts:
            return row  # a report for an earlier attempt
        attempts = row.result.setdefault("attempts", {})
        outcomes: dict[str, Any] = attempts.setdefault(str(row.attempts), {})
        if node.name in outcomes or row.state != StepState.RUNNING:
            return row
        outcomes[node.name] = {"ok": ok, "error": error, "result": dict(result or {})}
        row.save(update_fields=["result"])
        AgentCommand.objects.filter(step=row, node=node, command_id__endswith=f"#{row.attempts}").update(
            state=CommandState.DONE if ok else CommandState.FAILED,
            finished_at=timezone.now(),
            result=dict(result or {}),
        )
        audit.record(
            Actor.for_agent(node.name),
            "migration.step.report",
            row,
            job=migration.job,
            reason=error,
            payload={"step": step_id, "ok": ok, "attempt": row.attempts},
        )
        ready = [n for n in row.nodes if Node.objects.filter(name=n).exclude(status=NodeStatus.LOST).exists()]
        if ok and not all(n in outcomes for n in ready):
            return row  # other nodes still running their part
        _, execution = _load(migration)
        step_ok = ok and all(o["ok"] for o in outcomes.values())
        message = error or "; ".join(f"{n}: {o['error']}" for n, o in outcomes.items() if not o["ok"])
        execution.report(step_id, step_ok, message or None)
        _mark(row, StepState.DONE if step_ok else StepState.FAILED, error="" if step_ok else message)
        migration.execution = execution.to_json()
        migration.save(update_fields=["execution"])
        advance(migration)
        return row


def fail_stuck_steps(migration: Migration, *, now: Any = None) -> None:
    """A step whose agents stay silent past its deadline fails (hung agent, lost message)."""
    now = now or timezone.now()
    for row in migration.steps.filter(state=StepState.RUNNING):
        deadline = timedelta(
            seconds=max(settings.STEP_TIMEOUT_MIN_S, settings.STEP_TIMEOUT_FACTOR * row.estimated_s)
        )
        if row.started_at and now - row.started_at > deadline:
            _, execution = _load(migration)
            execution.report(row.step_id, False, "timed out waiting for the agents")
            _mark(row, StepState.FAILED, error="timed out waiting for the agents")
            migration.execution = execution.to_json()
            migration.save(update_fields=["execution"])
            advance(migration)


def roll_back_node(node: Node, actor: Actor) -> list[Migration]:
    """A node was lost: the steps it was running fail, so their migrations roll back (or roll
    forward past a point of no return, skipping the lost node). On a node whose workers run on
    without their agent (``steps_outlive_agent``) a point of no return is the exception: a
    restarted agent carries it out again and reports, and it may already have taken effect, so
    it is waited for (its deadline in ``fail_stuck_steps`` bounds the wait), never rolled back
    behind the workers' backs."""
    touched = []

    def running_there(steps: QuerySet[MigrationStep]) -> QuerySet[MigrationStep]:
        steps = steps.filter(state=StepState.RUNNING, nodes__contains=[node.name])
        if node.steps_outlive_agent:
            steps = steps.exclude(point_of_no_return=True, is_rollback=False)
        return steps

    if node.steps_outlive_agent:
        waited = MigrationStep.objects.filter(
            state=StepState.RUNNING, nodes__contains=[node.name], point_of_no_return=True, is_rollback=False
        )
        for migration in Migration.objects.filter(pk__in=waited.values("migration_id")).select_related("job"):
            audit.record(
                actor,
                "migration.node_lost",
                migration,
                job=migration.job,
                reason=(
                    f"node {node.name} lost at the point of no return: its workers run on without "
                    f"the agent, so the step is waited for, not rolled back"
                ),
            )
    for migration_pk in set(
        running_there(MigrationStep.objects.all()).values_list("migration_id", flat=True)
    ):
        with transaction.atomic():
            migration = Migration.objects.select_for_update().get(pk=migration_pk)
            if migration.state not in OPEN_MIGRATION_STATES:
                continue
            for row in running_there(migration.steps.all()):
                _, execution = _load(migration)
                message = f"node {node.name} lost"
                if row.is_rollback:
                    execution.report(row.step_id, True)
                    _mark(row, StepState.DONE)
                else:
                    execution.report(row.step_id, False, message)
                    _mark(row, StepState.FAILED, error=message)
                migration.execution = execution.to_json()
                migration.save(update_fields=["execution"])
            audit.record(
                actor, "migration.node_lost", migration, job=migration.job, reason=f"node {node.name} lost"
            )
            advance(migration)
            touched.append(migration)
    return touched


# --- finishing ---------------------------------------------------------------------------------


def _finish(migration: Migration, plan: MigrationPlan, execution: PlanExecution) -> None:
    target = {
        "committed": MigrationState.COMMITTED,
        "rolled_back": MigrationState.ROLLED_BACK,
        "failed": MigrationState.FAILED,
    }[execution.state]
    if migration.state == target:
        return
    if migration.state == MigrationState.RUNNING and target == MigrationState.ROLLED_BACK:
        _set_state(migration, MigrationState.ROLLING_BACK)
    committed = set(execution.committed_groups)
    _apply_ownership(migration, plan, committed)
    end_reservations(migration.migration_id)
    # Rows follow the execution's final view (skipped, rolled back).
    for step_id, state in execution.states().items():
        row = MigrationStep.objects.filter(step_id=step_id).first()
        if row is not None and row.state != state.value:
            row.check_transition(state.value)
            row.state = state.value
            row.save(update_fields=["state"])
    migration.finished_at = timezone.now()
    migration.error = "; ".join(
        f"{s}: {e}" for s in (row.step_id for row in migration.steps.all()) if (e := execution.error(s))
    )
    migration.check_transition(target)
    migration.state = target
    # The execution as it ended: a later advance (the tick's, after fail_stuck_steps) then
    # finds it finished instead of replaying the steps that finished it.
    migration.execution = execution.to_json()
    migration.save(update_fields=["state", "finished_at", "error", "execution"])
    verb = {"committed": "migration.commit", "rolled_back": "migration.rollback", "failed": "migration.fail"}
    audit.record(
        Actor.scheduler(),
        verb[execution.state],
        migration,
        job=migration.job,
        reason=migration.error,
        payload={"committed_groups": sorted(committed)},
    )
    events.publish("migration", migration_event(migration), job_id=migration.job_id, cluster=True)
    snapshots.take(migration.job, cause="migration")


def _apply_ownership(migration: Migration, plan: MigrationPlan, committed: set[str]) -> None:
    """In one transaction: the donor's leaving workers stop, the recipient's new workers own the moved
    devices. Only sides past their point of no return change."""
    decision = plan.decision
    moved = list(decision.device_ids)
    devices = {d.uid: d for d in Device.objects.select_for_update().filter(uid__in=moved)}
    if decision.donor and decision.donor in committed:
        leaving = _step_workers(plan, decision.donor, (StepKind.RELEASE_DEVICES,))
        Worker.objects.filter(name__in=leaving).update(state=WorkerState.STOPPED, stopped_at=timezone.now())
        release_devices(Device.objects.filter(uid__in=moved))
    if decision.recipient and decision.recipient in committed:
        group = WorkerGroup.objects.get(job=migration.job, name=decision.recipient)
        start = next(
            s for s in plan.steps if s.group_id == decision.recipient and s.kind is StepKind.START_WORKERS
        )
        for worker_name, device_ids in start.devices_by_worker().items():
            worker = Worker.objects.create(
                group=group, name=worker_name, state=WorkerState.RUNNING, started_at=timezone.now()
            )
            # Only devices this migration may hand out: the donor's (released above) or the ones it
            # reserved; a device another job owns is never taken over.
            on_device = Device.objects.filter(uid__in=device_ids).filter(
                Q(worker__isnull=True) | Q(worker__group__job=migration.job)
            )
            # A device on a lost node stays lost, owned, until its node comes back.
            on_device.filter(node__status=NodeStatus.LOST).update(
                worker=worker, status=DeviceStatus.LOST, reserved_by=""
            )
            on_device.exclude(node__status=NodeStatus.LOST).update(
                worker=worker, status=DeviceStatus.ALLOCATED, reserved_by=""
            )
    del devices  # locked for the transaction's duration


def _step_workers(plan: MigrationPlan, group: str, kinds: Iterable[StepKind]) -> list[str]:
    wanted = set(kinds)
    return [w for s in plan.steps if s.group_id == group and s.kind in wanted for w in s.worker_ids]


# --- operator requests ---------------------------------------------------------------------------


def request_manual_migration(
    job_id: int, *, donor: str, recipient: str, workers: int, actor: Actor, reason: str = ""
) -> Migration:
    """An operator moves ``workers`` of the donor's least busy workers to the recipient."""
    with transaction.atomic():
        job = Job.objects.select_for_update(no_key=True).get(pk=job_id)
        if job.state not in (JobState.RUNNING, JobState.PAUSED_SCHEDULING):
            raise ManualMigrationError("job", f"job is {job.state}; only running jobs can migrate")
        if open_migration(job) is not None:
            raise ManualMigrationError("job", "a migration of this job is still in flight")
        if placement_changes.open_change(job) is not None:
            raise ManualMigrationError("job", "the job is being placed anew; move its GPUs once that is done")
        graph = build_hypergraph(job, taken_at=timezone.now().timestamp())
        names = {n.id for n in graph.nodes}
        if donor not in names:
            raise ManualMigrationError("donor", f"no group {donor!r} in this job")
        if recipient not in names:
            raise ManualMigrationError("recipient", f"no group {recipient!r} in this job")
        if donor == recipient:
            raise ManualMigrationError("recipient", "donor and recipient must differ")
        if workers < 1:
            raise ManualMigrationError("workers", "must be at least 1")
        donor_node, recipient_node = graph.node(donor), graph.node(recipient)
        if workers > len(donor_node.workers):
            raise ManualMigrationError("workers", f"{donor} has only {len(donor_node.workers)} workers")
        leaving = sorted(donor_node.workers, key=lambda w: (w.utilisation, w.id))[:workers]
        device_ids = tuple(d.id for w in leaving for d in w.devices)
        decision = Decision(
            policy="manual",
            reason=Reason.OPERATOR_REQUEST,
            detail=reason or f"{actor.label} moved {workers} worker(s) from {donor} to {recipient}",
            donor=donor,
            recipient=recipient,
            device_ids=device_ids,
            donor_strategy=donor_node.strategy,
            recipient_strategy=recipient_node.strategy,
            at=graph.taken_at,
        )
        decision_row = SchedulingDecision.objects.create(
            job=job,
            policy="manual",
            reason=decision.reason.value,
            detail=decision.detail,
            donor=donor,
            recipient=recipient,
            device_uids=list(device_ids),
            chosen=decision.to_json(),
            requested_by=actor.label,
        )
        try:
            migration = create_migration(job, decision_row, decision, graph, actor=actor)
        except PlanError as exc:
            raise ManualMigrationError("workers", str(exc)) from exc
        audit.record(
            actor,
            "job.migrate",
            job,
            job=job,
            reason=decision.detail,
            payload={"migration": migration.migration_id},
        )
        return migration


# --- event payloads ------------------------------------------------------------------------------


def migration_event(migration: Migration) -> dict[str, Any]:
    return {
        "id": migration.pk,
        "migration_id": migration.migration_id,
        "state": migration.state,
        "donor": migration.donor,
        "recipient": migration.recipient,
        "strategy": migration.strategy,
        "devices": migration.device_uids,
        "error": migration.error,
    }


def step_event(row: MigrationStep) -> dict[str, Any]:
    return {
        "migration": row.migration.migration_id,
        "step_id": row.step_id,
        "kind": row.kind,
        "group": row.group,
        "state": row.state,
        "attempts": row.attempts,
        "is_rollback": row.is_rollback,
        "error": row.error,
        "duration_s": row.duration_s,
    }
