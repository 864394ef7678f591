"""The scheduling-policy interface and the base every policy builds on."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, ClassVar, Protocol

from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Decision, Reason
from scheduler.core.hypergraph import Device, Hypergraph, HyperNode
from scheduler.core.policies.moves import (
    Cooldowns,
    IterationClock,
    LoanBook,
    PendingMoves,
    ReturnMove,
    make_decision,
    movable_between_iterations,
)
from scheduler.core.policies.params import ParamSpec, ParamValue, resolve_params
from scheduler.core.predictor import ThroughputPredictor
from scheduler.core.signals import GroupSignals, MeasuredIteration

# Why a caller without ``placement_changes_supported`` leaves a re-planned placement undone.
PLACEMENT_CHANGE_UNSUPPORTED = "the caller does not place a running job anew"


class Placement(StrEnum):
    """How the job's components share GPUs."""

    COLOCATED = "colocated"  # every component time-shares all GPUs, stage by stage (verl)
    DISAGGREGATED = "disaggregated"  # each group owns its GPUs; stages overlap


class PlacementChange(Protocol):
    """A policy's re-planned placement for the next iteration (``replan.PlacementChoice``)."""

    @property
    def placement(self) -> Placement: ...

    @property
    def detail(self) -> str: ...


class SchedulingPolicy(Protocol):
    """A ``scheduler.core.decisions.Policy`` plus what the simulator and the backends need."""

    name: str
    placement: Placement
    placement_changes_supported: bool

    @property
    def params(self) -> Mapping[str, ParamValue]:
        """The resolved parameters, defaults filled in."""
        ...

    def decide(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> list[Decision]: ...

    def plan_initial_split(self, total_gpus: int, groups: Sequence[HyperNode]) -> dict[str, int] | None:
        """group id -> GPUs at job start, or None to keep the job spec's placement."""
        ...

    def on_iteration_end(
        self, graph: Hypergraph, now: float, signals: Mapping[str, GroupSignals] | None = None
    ) -> list[Decision]:
        """Moves for the iteration boundary. ``signals`` (the live tick passes them) lets a
        policy weigh each move at the job's measured migration costs; without them (the
        simulator) it applies its rule as is."""
        ...

    def observe_iteration(self, measured: MeasuredIteration) -> None:
        """The job's driver measured its latest finished iteration (a real runtime does; the
        simulator does not): for this tick, a boundary may learn from it."""
        ...

    def iteration_advanced(self, graph: Hypergraph) -> bool:
        """Whether ``graph`` is in a later iteration than the last one the policy saw, so the
        caller owes it ``on_iteration_end`` before the next ``decide``."""
        ...

    def next_placement(self) -> PlacementChange | None:
        """After ``on_iteration_end``: the placement the next iteration should run under, when
        the policy re-planned it (handed out once), else None."""
        ...

    def placement_refused(self, change: PlacementChange, why: str) -> None:
        """The caller could not carry out ``change``; the job keeps its placement."""
        ...

    def decision_refused(self, decision: Decision, why: str) -> None:
        """The caller did not carry out ``decision`` (its planner refused it, or it no longer fit
        the job when its turn came): nothing moved."""
        ...

    @property
    def replan_note(self) -> str:
        """What the last iteration boundary's re-planning measured and concluded ("" if none)."""
        ...

    @property
    def idle_note(self) -> str:
        """Why the last ``decide`` made no move: the best move it weighed and why it lost, or
        why it weighed none ("" when it moved, or has nothing to say)."""
        ...

    def state_to_json(self) -> dict[str, Any]:
        """What the policy remembers between ticks (loans, cooldowns, moves in flight)."""
        ...

    def load_state(self, data: Mapping[str, Any]) -> None: ...


class BasePolicy:
    """Params, predictor and cost model, plus the bookkeeping every dynamic policy needs.

    One instance serves one job: it remembers loans, cooldowns and moves in flight between
    ticks. A caller that rebuilds the policy every tick carries that memory with
    ``state_to_json`` / ``load_state``.
    """

    name: str = ""
    placement: Placement = Placement.DISAGGREGATED
    PARAMS: ClassVar[tuple[ParamSpec, ...]] = ()
    # A decision not visible in the hypergraph after this long is presumed failed.
    PENDING_TIMEOUT_S: ClassVar[float] = 30.0
    # Whether the caller can switch the job between colocated and disaggregated placement at an
    # iteration boundary (``next_placement``): the simulator can; a caller that cannot sets False.
    placement_changes_supported: bool = True

    def __init__(
        self,
        *,
        predictor: ThroughputPredictor,
        cost_model: MigrationCostModel,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self.predictor = predictor
        self.cost_model = cost_model
        self.params: dict[str, ParamValue] = resolve_params(self.name, self.PARAMS, params)
        self.cooldowns = Cooldowns(float(self.params.get("cooldown_s", 0.0)))
        self.loans = LoanBook()
        self.pending = PendingMoves(self.PENDING_TIMEOUT_S)
        self.clock = IterationClock()

    def param_float(self, name: str) -> float:
        return float(self.params[name])

    def param_int(self, name: str) -> int:
        return int(self.params[name])

    def param_bool(self, name: str) -> bool:
        return bool(self.params[name])

    def decide(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> list[Decision]:
        return []

    def plan_initial_split(self, total_gpus: int, groups: Sequence[HyperNode]) -> dict[str, int] | None:
        return None

    def on_iteration_end(
        self, graph: Hypergraph, now: float, signals: Mapping[str, GroupSignals] | None = None
    ) -> list[Decision]:
        return []

    def observe_iteration(self, measured: MeasuredIteration) -> None:
        return None

    def next_placement(self) -> PlacementChange | None:
        return None

    def placement_refused(self, change: PlacementChange, why: str) -> None:
        return None

    def decision_refused(self, decision: Decision, why: str) -> None:
        """It is no longer awaited (its groups may move again at once, not after the pending
        timeout), and a return's GPUs are owed again: the borrower still holds them."""
        self.pending.discard(decision)
        if decision.reason is Reason.RETURN_BORROWED and decision.donor and decision.recipient:
            self.loans.lend(decision.recipient, decision.donor, decision.device_ids, decision.at)

    @property
    def replan_note(self) -> str:
        return ""

    @property
    def idle_note(self) -> str:
        return ""

    def iteration_advanced(self, graph: Hypergraph) -> bool:
        seen = self.clock.iteration
        return seen is not None and graph.iteration > seen

    def _sync(self, graph: Hypergraph, now: float, free_devices: Sequence[Device] = ()) -> bool:
        """Bring the memory up to date with the graph; True when a new iteration began."""
        self.pending.refresh(graph, now, (d.id for d in free_devices))
        self.loans.reconcile(graph, self.pending.device_ids())
        return self.clock.observe(graph, now)

    def _issued(self, decisions: Sequence[Decision], now: float) -> list[Decision]:
        for decision in decisions:
            self.pending.add(decision)
            self.cooldowns.mark((decision.donor, decision.recipient), now)
        return list(decisions)

    def _return_loans(
        self, graph: Hypergraph, now: float, worth: Callable[[ReturnMove], bool] | None = None
    ) -> list[Decision]:
        """At an iteration boundary, every loan whose groups may move between iterations goes
        home (those ``worth`` approves, when given; the others stay on loan)."""
        decisions = []
        for move in self.loans.return_moves(graph, keep_a_worker=True):
            if not movable_between_iterations(move.borrower) or not movable_between_iterations(move.lender):
                continue
            if worth is not None and not worth(move):
                continue
            decisions.append(
                self._return_decision(
                    move,
                    f"iteration {graph.iteration} ended: {move.borrower.id} returns {len(move.devices)} "
                    f"borrowed GPUs to {move.lender.id}",
                    now,
                )
            )
            self.loans.settle(move.lender.id, move.borrower.id, [d.id for d in move.devices])
        return decisions

    def _return_decision(self, move: ReturnMove, detail: str, now: float) -> Decision:
        """``move``'s borrowed GPUs back to their lender."""
        return make_decision(
            self.name,
            Reason.RETURN_BORROWED,
            detail,
            donor=move.borrower,
            recipient=move.lender,
            device_ids=[d.id for d in move.devices],
            at=now,
        )

    def state_to_json(self) -> dict[str, Any]:
        return {
            "cooldowns": self.cooldowns.to_json(),
            "loans": self.loans.to_json(),
            "pending": self.pending.to_json(),
            "clock": self.clock.to_json(),
        }

    def load_state(self, data: Mapping[str, Any]) -> None:
        self.cooldowns.load(data.get("cooldowns", {}))
        self.loans.load(data.get("loans", []))
        self.pending.load(data.get("pending", []))
        self.clock.load(data.get("clock", {}))
