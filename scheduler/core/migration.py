"""The migration planner: a Decision becomes an ordered plan of idempotent steps.

A plan has one *side* per group the decision touches: the donor's release steps first, then the
recipient's grow steps, so the donor's devices are free before the recipient starts anything on
them, while the recipient's old workers keep running until its own switch. Each side has exactly
one point of no return (``switch``, or ``release_devices`` for a side without a switch); a failure
before it undoes that side's steps with their compensations in reverse order, a failure after it
is retried (rolled forward). See docs/migration-plans.md for the sequences and the argument that
no group is ever left half-switched.

Step semantics, for the executors (node agents, the simulator):

- ``worker_ids`` of ``start_workers`` are new, deterministic ids; worker ``k`` holds the ``k``-th
  run of ``gpus_per_worker`` devices of ``device_ids`` (see :meth:`PlannedStep.devices_by_worker`).
- ``switch`` atomically sets the group's membership to exactly its ``worker_ids``.
- ``destroy_old`` destroys what the switch superseded: the old process groups on every rank, and
  the workers it lists (the ranks that left; none when the trainer grew).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Decision
from scheduler.core.hypergraph import ComponentKind, Hypergraph, HyperNode, MigrationStrategy, Worker


class StepKind(StrEnum):
    # restart (reward, tool): workers leaving devices are drained and stopped, new ones started.
    DRAIN = "drain"
    STOP_WORKERS = "stop_workers"
    START_WORKERS = "start_workers"
    HEALTH_CHECK = "health_check"
    SWITCH = "switch"
    # workload (rollout, inference donors)
    PAUSE_WORKERS = "pause_workers"
    TAKE_BACK_REQUESTS = "take_back_requests"
    REDISTRIBUTE_REQUESTS = "redistribute_requests"
    RELEASE_DEVICES = "release_devices"
    # workload recipients (a serving group that grows): the members it had give the new ones a
    # share of the requests queued on them, which no router would otherwise send there
    SHED_REQUESTS = "shed_requests"
    # p2p (the trainer)
    RESERVE_DEVICES = "reserve_devices"
    TRANSFER_STATE = "transfer_state"
    REBUILD_GROUPS = "rebuild_groups"
    BARRIER = "barrier"
    DESTROY_OLD = "destroy_old"
    # compensations
    UNDRAIN = "undrain"
    RESTART_WORKERS = "restart_workers"
    DESTROY_NEW = "destroy_new"
    RESUME_WORKERS = "resume_workers"
    RETURN_REQUESTS = "return_requests"
    RELEASE_RESERVATION = "release_reservation"
    DISCARD_TRANSFER = "discard_transfer"
    RESTORE_GROUPS = "restore_groups"


class StepState(StrEnum):
    PLANNED = "planned"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"
    SKIPPED = "skipped"


class PlanError(ValueError):
    """The decision cannot be turned into a valid plan against this hypergraph."""


COMPENSATION: Mapping[StepKind, StepKind | None] = {
    StepKind.DRAIN: StepKind.UNDRAIN,
    StepKind.STOP_WORKERS: StepKind.RESTART_WORKERS,
    StepKind.START_WORKERS: StepKind.DESTROY_NEW,
    StepKind.HEALTH_CHECK: None,
    StepKind.SWITCH: None,
    StepKind.PAUSE_WORKERS: StepKind.RESUME_WORKERS,
    # Requests still held by the migration go back to the resumed donors; once redistributed
    # they are running on the remaining workers, which is as good (the workers are stateless).
    StepKind.TAKE_BACK_REQUESTS: StepKind.RETURN_REQUESTS,
    StepKind.REDISTRIBUTE_REQUESTS: None,
    StepKind.RELEASE_DEVICES: None,
    StepKind.SHED_REQUESTS: None,  # after the switch: rolls forward only
    StepKind.RESERVE_DEVICES: StepKind.RELEASE_RESERVATION,
    StepKind.TRANSFER_STATE: StepKind.DISCARD_TRANSFER,
    StepKind.REBUILD_GROUPS: StepKind.RESTORE_GROUPS,
    StepKind.BARRIER: None,
    StepKind.DESTROY_OLD: None,
}


@dataclass(frozen=True)
class PlannedStep:
    step_id: str  # f"{migration_id}:{index:02d}:{kind}", so a replayed step is recognised
    index: int
    kind: StepKind
    group_id: str
    strategy: MigrationStrategy
    device_ids: tuple[str, ...]
    worker_ids: tuple[str, ...]
    estimated_s: float
    rollback_kind: StepKind | None  # the compensating step, None when nothing to undo
    point_of_no_return: bool  # once done, this side of the plan only rolls forward
    rollback_estimated_s: float = 0.0
    # shed_requests: the fraction of each listed worker's queued (not yet running) requests it
    # gives up; 0 for every other kind
    share: float = 0.0

    def devices_by_worker(self) -> dict[str, tuple[str, ...]]:
        """worker id -> its devices: ``device_ids`` split evenly, in order, across ``worker_ids``."""
        if not self.worker_ids or len(self.device_ids) % len(self.worker_ids):
            return {}
        per_worker = len(self.device_ids) // len(self.worker_ids)
        return {
            worker_id: self.device_ids[k * per_worker : (k + 1) * per_worker]
            for k, worker_id in enumerate(self.worker_ids)
        }

    def compensation(self) -> PlannedStep | None:
        """The step that undoes this one, on the same workers and devices."""
        if self.rollback_kind is None:
            return None
        migration_id = self.step_id.split(":", 1)[0]
        return PlannedStep(
            step_id=step_id_for(migration_id, self.index, self.rollback_kind),
            index=self.index,
            kind=self.rollback_kind,
            group_id=self.group_id,
            strategy=self.strategy,
            device_ids=self.device_ids,
            worker_ids=self.worker_ids,
            estimated_s=self.rollback_estimated_s,
            rollback_kind=None,
            point_of_no_return=False,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "step_id": self.step_id,
            "index": self.index,
            "kind": self.kind.value,
            "group_id": self.group_id,
            "strategy": self.strategy.value,
            "device_ids": list(self.device_ids),
            "worker_ids": list(self.worker_ids),
            "estimated_s": self.estimated_s,
            "rollback_kind": self.rollback_kind.value if self.rollback_kind else None,
            "point_of_no_return": self.point_of_no_return,
            "rollback_estimated_s": self.rollback_estimated_s,
            "share": self.share,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlannedStep:
        return cls(
            step_id=data["step_id"],
            index=int(data["index"]),
            kind=StepKind(data["kind"]),
            group_id=data["group_id"],
            strategy=MigrationStrategy(data["strategy"]),
            device_ids=tuple(data["device_ids"]),
            worker_ids=tuple(data["worker_ids"]),
            estimated_s=float(data["estimated_s"]),
            rollback_kind=StepKind(data["rollback_kind"]) if data["rollback_kind"] else None,
            point_of_no_return=bool(data["point_of_no_return"]),
            rollback_estimated_s=float(data.get("rollback_estimated_s", 0.0)),
            share=float(data.get("share", 0.0)),
        )


def step_id_for(migration_id: str, index: int, kind: StepKind) -> str:
    return f"{migration_id}:{index:02d}:{kind.value}"


@dataclass(frozen=True)
class MigrationPlan:
    migration_id: str
    decision: Decision
    steps: tuple[PlannedStep, ...]

    @property
    def estimated_s(self) -> float:
        return sum(step.estimated_s for step in self.steps)

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups the plan touches, in the order their sides run."""
        return tuple(dict.fromkeys(step.group_id for step in self.steps))

    def step(self, step_id: str) -> PlannedStep:
        for step in self.steps:
            if step.step_id == step_id:
                return step
        raise KeyError(step_id)

    def rollback_steps(self, failed_index: int) -> tuple[PlannedStep, ...]:
        """Compensations, in reverse order, after the step at ``failed_index`` failed.

        Covers the steps done since the last point of no return before the failure, plus the
        failed step itself: it may have half-applied, and compensations are idempotent. Steps
        before a passed point of no return are committed and never compensated; a failure after
        its side's point of no return therefore gets no compensations (it rolls forward).
        """
        if not 0 <= failed_index < len(self.steps):
            raise IndexError(failed_index)
        committed_through = max(
            (s.index for s in self.steps[:failed_index] if s.point_of_no_return), default=-1
        )
        compensations = (
            s.compensation() for s in reversed(self.steps[committed_through + 1 : failed_index + 1])
        )
        return tuple(c for c in compensations if c is not None)

    def to_json(self) -> dict[str, Any]:
        return {
            "migration_id": self.migration_id,
            "decision": self.decision.to_json(),
            "steps": [s.to_json() for s in self.steps],
            "estimated_s": self.estimated_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MigrationPlan:
        return cls(
            migration_id=data["migration_id"],
            decision=Decision.from_json(data["decision"]),
            steps=tuple(PlannedStep.from_json(s) for s in data["steps"]),
        )


# --- planning ------------------------------------------------------------------------------


@dataclass
class _SideBuilder:
    """Accumulates one side's steps; indices are assigned when the plan is assembled."""

    group_id: str
    strategy: MigrationStrategy
    steps: list[tuple[StepKind, tuple[str, ...], tuple[str, ...], float, float, float]] = field(
        default_factory=list
    )
    point_of_no_return: StepKind | None = None

    def add(
        self,
        kind: StepKind,
        workers: Sequence[Worker] | Sequence[str],
        devices: Sequence[str],
        estimated_s: float,
        rollback_estimated_s: float = 0.0,
        *,
        share: float = 0.0,
    ) -> None:
        worker_ids = tuple(w if isinstance(w, str) else w.id for w in workers)
        self.steps.append((kind, worker_ids, tuple(devices), estimated_s, rollback_estimated_s, share))


def plan_migration(
    decision: Decision,
    graph: Hypergraph,
    cost_model: MigrationCostModel,
    *,
    migration_id: str,
    requests_taken_back: int = 0,
) -> MigrationPlan:
    """Turn ``decision`` into an ordered plan against ``graph``; raises PlanError if it cannot apply.

    The same inputs always give the same plan (step ids, new worker ids, order), so re-planning a
    replayed decision yields identical rows.
    """
    if not migration_id or ":" in migration_id:
        raise PlanError("migration_id must be non-empty and must not contain ':'")
    moved = decision.device_ids
    if not moved:
        raise PlanError("decision moves no devices")
    if len(set(moved)) != len(moved):
        raise PlanError("decision lists a device twice")
    if decision.donor is None and decision.recipient is None:
        raise PlanError("decision has neither donor nor recipient")
    if decision.donor == decision.recipient:
        raise PlanError("donor and recipient are the same group")
    if shared := time_shared_devices(graph, moved):
        listed = "; ".join(f"{device} by {', '.join(groups)}" for device, groups in shared.items())
        raise PlanError(
            f"devices are time-shared (colocated placement), and time-shared devices do not move: {listed}"
        )

    donor = _node(graph, decision.donor, "donor") if decision.donor is not None else None
    recipient = _node(graph, decision.recipient, "recipient") if decision.recipient is not None else None
    sides: list[_SideBuilder] = []

    if donor is not None:
        held = set(donor.device_ids)
        if missing := [d for d in moved if d not in held]:
            raise PlanError(f"donor {donor.id} does not hold devices {missing}")
        strategy = decision.donor_strategy or donor.strategy
        sides.append(_donor_side(donor, strategy, set(moved), cost_model, requests_taken_back))
    else:
        holders = graph.allocation()
        if busy := [d for d in moved if any(d in devices for devices in holders.values())]:
            raise PlanError(f"devices {busy} are not free")

    if recipient is not None:
        if overlap := [d for d in moved if d in set(recipient.device_ids)]:
            raise PlanError(f"recipient {recipient.id} already holds devices {overlap}")
        if donor is not None:
            hardware = {d.id: d.hardware for w in donor.workers for d in w.devices}
            if refused := sorted({hardware[d] for d in moved if not recipient.accepts_hardware(hardware[d])}):
                raise PlanError(f"recipient {recipient.id} does not accept hardware {refused}")
        strategy = decision.recipient_strategy or recipient.strategy
        sides.append(_recipient_side(recipient, strategy, moved, cost_model, migration_id))

    steps: list[PlannedStep] = []
    for side in sides:
        for kind, worker_ids, device_ids, estimated_s, rollback_estimated_s, share in side.steps:
            index = len(steps)
            steps.append(
                PlannedStep(
                    step_id=step_id_for(migration_id, index, kind),
                    index=index,
                    kind=kind,
                    group_id=side.group_id,
                    strategy=side.strategy,
                    device_ids=device_ids,
                    worker_ids=worker_ids,
                    estimated_s=estimated_s,
                    rollback_kind=COMPENSATION[kind],
                    point_of_no_return=kind is side.point_of_no_return,
                    rollback_estimated_s=rollback_estimated_s if COMPENSATION[kind] else 0.0,
                    share=share,
                )
            )
    # Workers that take turns on time-shared devices are outside what a migration step can do (the
    # agents refuse them): a plan whose steps would pause, switch or hand work to one is refused
    # whole, before anything runs, rather than failing half-way on one node and not on another.
    sharing = time_sharing_workers(graph)
    for step in steps:
        if touched := sorted(sharing & set(step.worker_ids)):
            raise PlanError(
                f"{step.group_id}'s {step.kind.value} step would act on workers on time-shared devices "
                f"(colocated placement), which migration steps do not apply to: {', '.join(touched)}"
            )
    return MigrationPlan(migration_id=migration_id, decision=decision, steps=tuple(steps))


def time_shared_devices(graph: Hypergraph, device_ids: Iterable[str]) -> dict[str, list[str]]:
    """Of ``device_ids``, those that more than one worker holds (groups of a colocated placement
    taking turns on them), each with the groups holding it."""
    wanted = set(device_ids)
    holders: dict[str, list[tuple[str, str]]] = {}
    for node in graph.nodes:
        for worker in node.workers:
            for device in worker.devices:
                if device.id in wanted:
                    holders.setdefault(device.id, []).append((node.id, worker.id))
    return {
        device: sorted({group for group, _ in held})
        for device, held in sorted(holders.items())
        if len(held) > 1
    }


def time_sharing_workers(graph: Hypergraph) -> set[str]:
    """Workers holding a device that another worker holds too (a colocated placement)."""
    holders: dict[str, list[str]] = {}
    for node in graph.nodes:
        for worker in node.workers:
            for device in worker.devices:
                holders.setdefault(device.id, []).append(worker.id)
    return {worker for held in holders.values() if len(held) > 1 for worker in held}


def _node(graph: Hypergraph, group_id: str, role: str) -> HyperNode:
    try:
        return graph.node(group_id)
    except KeyError:
        raise PlanError(f"{role} {group_id!r} is not a group of job {graph.job_id}") from None


def _donor_side(
    donor: HyperNode,
    strategy: MigrationStrategy,
    moved: set[str],
    cost_model: MigrationCostModel,
    requests_taken_back: int,
) -> _SideBuilder:
    leaving = [w for w in donor.workers if any(d.id in moved for d in w.devices)]
    if partial := [w.id for w in leaving if not all(d.id in moved for d in w.devices)]:
        raise PlanError(f"moving part of a worker's devices is not possible: {partial}")
    leaving_ids = {w.id for w in leaving}
    staying = [w for w in donor.workers if w.id not in leaving_ids]
    if not donor.is_valid_worker_count(len(staying)):
        raise PlanError(f"donor {donor.id} cannot run with {len(staying)} workers")
    leaving_devices = [d.id for w in leaving for d in w.devices]
    staying_devices = [d.id for w in staying for d in w.devices]
    gpus_moved = len(leaving_devices)
    side = _SideBuilder(donor.id, strategy)

    if strategy is MigrationStrategy.WORKLOAD:
        total = cost_model.estimate_s(
            strategy,
            gpus_moved=gpus_moved,
            recipient_gpus_after=len(staying_devices),
            requests_taken_back=requests_taken_back,
        )
        pause = min(cost_model.workload_pause_s, total)
        redistribute = total - pause
        side.add(StepKind.PAUSE_WORKERS, leaving, leaving_devices, pause / 2, pause / 2)
        side.add(StepKind.TAKE_BACK_REQUESTS, leaving, leaving_devices, pause / 2, redistribute)
        side.add(StepKind.REDISTRIBUTE_REQUESTS, staying, staying_devices, redistribute)
        side.add(StepKind.RELEASE_DEVICES, leaving, leaving_devices, 0.0)
        side.point_of_no_return = StepKind.RELEASE_DEVICES
    elif strategy is MigrationStrategy.RESTART:
        restart = cost_model.estimate_s(
            strategy, gpus_moved=gpus_moved, recipient_gpus_after=len(staying_devices)
        )
        side.add(StepKind.DRAIN, leaving, leaving_devices, restart / 2)
        side.add(StepKind.STOP_WORKERS, leaving, leaving_devices, restart / 2, restart)
        side.add(StepKind.RELEASE_DEVICES, leaving, leaving_devices, 0.0)
        side.point_of_no_return = StepKind.RELEASE_DEVICES
    else:
        # The ranks that stay receive the leaving ranks' shards of the trainer state.
        transfer, rebuild, barrier, switch = _p2p_split(cost_model, gpus_moved, len(staying_devices))
        side.add(StepKind.TRANSFER_STATE, leaving, leaving_devices, transfer)
        side.add(StepKind.REBUILD_GROUPS, staying, staying_devices, rebuild, rebuild)
        side.add(StepKind.BARRIER, staying, staying_devices, barrier)
        side.add(StepKind.SWITCH, staying, staying_devices, switch)
        side.add(StepKind.DESTROY_OLD, leaving, leaving_devices, 0.0)
        side.add(StepKind.RELEASE_DEVICES, leaving, leaving_devices, 0.0)
        side.point_of_no_return = StepKind.SWITCH
    return side


def _recipient_side(
    recipient: HyperNode,
    strategy: MigrationStrategy,
    moved: tuple[str, ...],
    cost_model: MigrationCostModel,
    migration_id: str,
) -> _SideBuilder:
    per_worker = recipient.parallelism.gpus_per_worker
    if len(moved) % per_worker:
        raise PlanError(
            f"recipient {recipient.id} needs {per_worker} devices per worker, got {len(moved)} devices"
        )
    new_workers = [f"{recipient.id}-{migration_id}-w{k}" for k in range(len(moved) // per_worker)]
    if clash := {w.id for w in recipient.workers} & set(new_workers):
        raise PlanError(f"new worker ids already exist: {sorted(clash)}")
    if not recipient.is_valid_worker_count(len(recipient.workers) + len(new_workers)):
        raise PlanError(
            f"recipient {recipient.id} cannot run with {len(recipient.workers) + len(new_workers)} workers"
        )
    members = [w.id for w in recipient.workers] + new_workers
    devices_after = list(recipient.device_ids) + list(moved)
    side = _SideBuilder(recipient.id, strategy)

    if strategy is MigrationStrategy.P2P:
        transfer, rebuild, barrier, switch = _p2p_split(cost_model, len(moved), len(devices_after))
        side.add(StepKind.RESERVE_DEVICES, (), moved, 0.0)
        side.add(StepKind.START_WORKERS, new_workers, moved, 0.0)
        side.add(StepKind.TRANSFER_STATE, new_workers, moved, transfer)
        side.add(StepKind.REBUILD_GROUPS, members, devices_after, rebuild, rebuild)
        side.add(StepKind.BARRIER, members, devices_after, barrier)
        side.add(StepKind.SWITCH, members, devices_after, switch)
        # Nothing to kill when growing: only the old process groups go.
        side.add(StepKind.DESTROY_OLD, (), (), 0.0)
    else:
        if strategy is MigrationStrategy.RESTART:
            total = cost_model.estimate_s(
                strategy, gpus_moved=len(moved), recipient_gpus_after=len(devices_after)
            )
        else:
            # A serving group grows by launching engines; new requests reach them after the switch.
            total = cost_model.engine_launch_s()
        side.add(StepKind.START_WORKERS, new_workers, moved, 0.6 * total)
        side.add(StepKind.HEALTH_CHECK, new_workers, moved, 0.3 * total)
        side.add(StepKind.SWITCH, members, devices_after, 0.1 * total)
        if (
            strategy is MigrationStrategy.WORKLOAD
            and recipient.kind is ComponentKind.ROLLOUT
            and recipient.workers
        ):
            # Requests already dispatched wait on the old members (an iteration's batch goes out
            # the moment it opens, before GPUs lent away can come home): each old member hands
            # the new ones their share of its queue, so the group ends up evenly loaded.
            old = recipient.workers
            old_devices = [d.id for w in old for d in w.devices]
            share = len(new_workers) / (len(old) + len(new_workers))
            side.add(StepKind.SHED_REQUESTS, old, old_devices, cost_model.workload_pause_s / 2, share=share)
            side.add(StepKind.REDISTRIBUTE_REQUESTS, new_workers, moved, cost_model.workload_pause_s / 2)
    side.point_of_no_return = StepKind.SWITCH
    return side


def _p2p_split(
    cost_model: MigrationCostModel, gpus_moved: int, gpus_after: int
) -> tuple[float, float, float, float]:
    """transfer, rebuild, barrier, switch: the bytes/bandwidth part and the fixed part, split."""
    total = cost_model.estimate_s(
        MigrationStrategy.P2P, gpus_moved=gpus_moved, recipient_gpus_after=gpus_after
    )
    fixed = min(cost_model.p2p_fixed_s, total)
    return total - fixed, 0.6 * fixed, 0.3 * fixed, 0.1 * fixed


# --- execution -----------------------------------------------------------------------------

PlanState = Literal["planned", "running", "committed", "rolling_back", "rolled_back", "failed"]


class PlanExecution:
    """A pure state machine over a plan: what a tick or an agent loop drives.

    ``next_step()`` issues the step to run (marking it running; asking again returns the same
    step), ``report()`` records its outcome. Reports are idempotent: the first outcome of an
    issued step wins, and a repeated or late report is ignored. A step that fails before its
    side's point of no return starts the rollback (``next_step`` then issues compensations); one
    that fails after it is retried up to ``max_attempts`` times, then the plan is ``failed``
    (needs an operator, but never half-switched). A compensation that keeps failing also ends in
    ``failed``.
    """

    def __init__(self, plan: MigrationPlan, *, max_attempts: int = 3) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.plan = plan
        self.max_attempts = max_attempts
        self._states: dict[str, StepState] = {s.step_id: StepState.PLANNED for s in plan.steps}
        self._errors: dict[str, str] = {}
        self._failures: dict[str, int] = {}
        self._compensations: tuple[PlannedStep, ...] = ()
        self._failed_index: int | None = None
        self._gave_up = False

    # -- queries ---------------------------------------------------------------------------

    @property
    def state(self) -> PlanState:
        if self._gave_up:
            return "failed"
        if self._failed_index is not None:
            if all(self._states[c.step_id] is StepState.DONE for c in self._compensations):
                return "rolled_back"
            return "rolling_back"
        if all(self._states[s.step_id] is StepState.DONE for s in self.plan.steps):
            return "committed"
        if all(state is StepState.PLANNED for state in self._states.values()):
            return "planned"
        return "running"

    @property
    def committed_groups(self) -> tuple[str, ...]:
        """Groups whose side passed its point of no return: their new layout is final.

        After a rollback this may still name the donor (its devices then sit in the free pool).
        """
        return tuple(
            s.group_id
            for s in self.plan.steps
            if s.point_of_no_return and self._states[s.step_id] is StepState.DONE
        )

    @property
    def compensations(self) -> tuple[PlannedStep, ...]:
        return self._compensations

    def step_state(self, step_id: str) -> StepState:
        """State of a plan step or a compensation step."""
        if step_id not in self._states:
            raise KeyError(step_id)
        if self.state == "rolled_back" and step_id in self._step_ids():
            return self._final_state_after_rollback(self.plan.step(step_id))
        return self._states[step_id]

    def states(self) -> dict[str, StepState]:
        """Every known step id (plan steps, then compensations) -> its state."""
        return {step_id: self.step_state(step_id) for step_id in self._states}

    def error(self, step_id: str) -> str | None:
        return self._errors.get(step_id)

    def next_step(self) -> PlannedStep | None:
        state = self.state
        if state in ("committed", "rolled_back", "failed"):
            return None
        queue = self._compensations if state == "rolling_back" else self.plan.steps
        for step in queue:
            if self._states[step.step_id] is not StepState.DONE:
                self._states[step.step_id] = StepState.RUNNING
                return step
        return None

    # -- reports ---------------------------------------------------------------------------

    def report(self, step_id: str, ok: bool, error: str | None = None) -> None:
        if step_id not in self._states:
            raise KeyError(f"unknown step {step_id!r}")
        current = self._states[step_id]
        if current is not StepState.RUNNING:
            if current is StepState.PLANNED:
                raise ValueError(f"step {step_id!r} was reported before it was issued")
            return  # done already, or a failure already handled: a repeat or a late report
        if ok:
            self._states[step_id] = StepState.DONE
            return
        self._states[step_id] = StepState.FAILED
        if error:
            self._errors[step_id] = error
        self._failures[step_id] = self._failures.get(step_id, 0) + 1
        if any(c.step_id == step_id for c in self._compensations):
            if self._failures[step_id] >= self.max_attempts:
                self._gave_up = True
            return
        step = self.plan.step(step_id)
        if self._side_committed(step):
            if self._failures[step_id] >= self.max_attempts:
                self._gave_up = True
            return
        self._start_rollback(step)

    def _side_committed(self, step: PlannedStep) -> bool:
        return any(
            s.point_of_no_return and s.group_id == step.group_id and self._states[s.step_id] is StepState.DONE
            for s in self.plan.steps[: step.index]
        )

    def _start_rollback(self, failed: PlannedStep) -> None:
        self._failed_index = failed.index
        self._compensations = self.plan.rollback_steps(failed.index)
        for compensation in self._compensations:
            self._states[compensation.step_id] = StepState.PLANNED

    def _step_ids(self) -> set[str]:
        return {s.step_id for s in self.plan.steps}

    def _final_state_after_rollback(self, step: PlannedStep) -> StepState:
        state = self._states[step.step_id]
        if state is StepState.PLANNED:
            return StepState.SKIPPED
        compensation = step.compensation()
        if compensation is not None and compensation.step_id in self._states:
            return StepState.ROLLED_BACK
        return state

    # -- persistence -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The execution's own state (not the plan), to resume it in a later tick."""
        return {
            "migration_id": self.plan.migration_id,
            "max_attempts": self.max_attempts,
            "states": {k: v.value for k, v in self._states.items()},
            "errors": dict(self._errors),
            "failures": dict(self._failures),
            "failed_index": self._failed_index,
            "gave_up": self._gave_up,
        }

    @classmethod
    def from_json(cls, plan: MigrationPlan, data: Mapping[str, Any]) -> PlanExecution:
        if data["migration_id"] != plan.migration_id:
            raise ValueError("execution state belongs to another migration")
        execution = cls(plan, max_attempts=int(data["max_attempts"]))
        if data["failed_index"] is not None:
            execution._start_rollback(plan.steps[int(data["failed_index"])])
        known = set(execution._states)
        if unknown := set(data["states"]) - known:
            raise ValueError(f"unknown step ids {sorted(unknown)}")
        execution._states.update({k: StepState(v) for k, v in data["states"].items()})
        execution._errors = dict(data["errors"])
        execution._failures = {k: int(v) for k, v in data["failures"].items()}
        execution._gave_up = bool(data["gave_up"])
        return execution
