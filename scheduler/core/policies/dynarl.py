"""DynaRL's scheduling policy (Algorithm 1): shrink drained groups, grow the stage that paces the job."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from scheduler.core.decisions import Candidate, Decision, Prediction, Reason
from scheduler.core.hypergraph import ComponentKind, Device, Hypergraph, HyperNode, MigrationStrategy, Worker
from scheduler.core.policies.base import (
    PLACEMENT_CHANGE_UNSUPPORTED,
    BasePolicy,
    Placement,
    PlacementChange,
)
from scheduler.core.policies.moves import (
    Loan,
    PendingMove,
    ReturnMove,
    bundles,
    devices_of,
    make_decision,
    migration_cost_s,
    movable_at_runtime,
    movable_between_iterations,
    pick_free_devices,
    receive_problem,
    release_problem,
    valid_growth_steps,
)
from scheduler.core.policies.outcomes import MoveOutcomes, OpenOutcome, move_kind
from scheduler.core.policies.pace import PaceMemory, PaceModel, consolidation_slowdown, largest_valid_gpus
from scheduler.core.policies.params import ParamSpec
from scheduler.core.policies.replan import (
    PAYBACK_ITERATIONS,
    IterationLedger,
    IterationRecord,
    PlacementChoice,
    PlacementModel,
    Replanner,
    busy_gpu_s,
    measured_record,
    seconds,
    time_shared,
    work,
)
from scheduler.core.signals import GroupSignals, MeasuredIteration

NOT_BEST = "a better candidate was chosen"
# Drained groups whose idle workers a pooled move may combine (see ``_pooled_candidates``).
POOL_MAX_DONORS = 2
# A log-prob backlog counts as pacing the iteration once this share of the rollout's batch is done.
BACKLOG_FROM_PROGRESS = 0.75
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Move:
    """A move being weighed: ``workers`` of ``donor`` (or ``devices`` from the free pool) to
    ``recipient``."""

    donor: HyperNode | None
    recipient: HyperNode
    devices: tuple[Device, ...]
    workers: tuple[Worker, ...] = ()

    @property
    def gpus(self) -> int:
        return len(self.devices)


class DynaRLPolicy(BasePolicy):
    """Algorithm 1 of DynaRL, its prediction step made concrete by a pace model.

    Trigger (the paper's): when more than ``low_fraction_threshold`` of a dynamic group's workers
    (rollout, inference) stay under ``u_low`` for ``sustain_s``, the group is a donor; so is a
    static group (the trainer) that has nothing to do and nothing queued (``lend_idle_static``).

    Candidates: for each donor, the first k of its idle workers (whole recipient workers, k over
    the sizes both groups can run) go to a group with work waiting for it: the rollout with
    requests waiting for a slot, a log-prob group with a backlog, the trainer with ready
    mini-batches or one running (at most ``max_recipients``, the most pressed first;
    ``max_candidates`` sizes per donor). When several groups are drained at once, candidates
    also pool their idle workers: a trainer whose valid data-parallel sizes are powers of two
    may reach the next one only with the GPUs of a finished rollout and an idle log-prob group
    together. A pooled move is weighed as a whole and carried out leg by leg, one migration at a
    time, each leg as soon as the previous one has landed. GPUs a trainer lent while it waited
    go to no other group; a move to the trainer takes them after the donor's other idle GPUs.

    Prediction (``pace.PaceModel``): when the work the rollout is generating will be trained,
    from the rollout's remaining tail (learned from the job's previous rollout batch), the
    slowdown of consolidating its stragglers onto fewer engines (decode is memory-bound; the
    share of a step that grows with the batch is measured on the job's own resizes, starting
    from ``kv_share_prior``), and the pipeline's remaining GPU-seconds (predictor rates, tokens
    per iteration learned from the trainer, one of ``n_minibatches`` draining after the
    rollout). A candidate's gain is how much earlier that comes, net of the move's cost (GPUs in
    transit, a trainer paused for its state transfer; twice when the GPUs will have to come
    back). The best gain wins if it raises the predicted job throughput by ``min_gain_ratio``
    (hysteresis); a donor consolidated by a move keeps workers enough to stay under twice
    ``u_low``. Every candidate, chosen or not, is kept on the decision (and in
    ``last_candidates``) with its prediction and why it lost.

    Returns: borrowed GPUs go back when their group has work queued again and the pace model
    says the job gains from it; GPUs a synchronous rollout lent to a group that has finished its
    share of the iteration go home before the next batch; at iteration end every borrowed GPU
    goes home, unless the rollout already generates the next iteration (asynchronous RL).

    Pace rebalancing (beyond Algorithm 1): when a rollout has requests waiting for a slot and
    no group is idle, a working group gives it workers if that raises the predicted job
    throughput by ``rebalance_gain_ratio`` for ``sustain_s`` (asynchronous RL, where a new batch
    arrives while every stage is busy). The same goes for a log-prob group in a synchronous
    iteration whose remaining work, at its size, outlasts the rollout once most of the batch is
    generated (responses that grew past what the split was planned for): it paces the
    iteration's end, and the working rollout gives it engines.

    Re-planning (``replan``): every iteration is measured from the same signals (the rollout's
    body and tail, the pipeline's busy GPU-seconds; ``replan.IterationLedger``). At the boundary
    the next iteration's placement is chosen from what the job measured (``replan.Replanner``):
    time-sharing every GPU (colocated) when it is predicted at least ``replan_margin`` faster,
    switch included, and back when the tail returns; a placement never run on the job must beat
    the margin by the model's own measured error. Disaggregated, the base split (the rollout's
    GPUs at the start of an iteration) shifts by whole workers when the placement model predicts
    the shifted split ``replan_margin`` faster (``bounded_replan_margin`` for a shift to the
    rollout that would cost nothing even if the rollout gained nothing from it). The live
    control plane cannot switch a running job's placement (``placement_changes_supported``):
    there the choice is only recorded.

    Do no harm (``outcomes.MoveOutcomes``): per kind of move (which kind of group gave to which,
    and each direction of a re-planned split), what the moves were predicted to gain is held
    against what the iteration measured; a kind that gains less is trusted less, a kind that
    loses is not made for ``probation_iterations`` iterations.

    Placement: ``plan_initial_split`` keeps the job spec's split except the trainer, which starts
    at its smallest valid size (in a synchronous iteration it has nothing to train until its
    first mini-batch is complete); its other GPUs go to the groups that have work from the
    first seconds (rollout, log-probs) in proportion to the spec's split.

    | parameter | default | meaning |
    | --- | --- | --- |
    | `u_low` | 0.2 | utilisation under which a worker counts as idle (configure the signal window with it) |
    | `low_fraction_threshold` | 0.5 | fraction of a group's workers that must be idle to trigger |
    | `sustain_s` | 10.0 | seconds the trigger must hold; the signal window counts towards it |
    | `cooldown_s` | 10.0 | no new move touching a group for this long after its last one (a signal window); a group done with its share of a synchronous iteration lends regardless |
    | `min_gain_ratio` | 0.05 | hysteresis: predicted job throughput gain a move must reach |
    | `max_candidates` | 16 | shrink candidates weighed per donor (sizes spread over the range) |
    | `max_recipients` | 3 | groups with queued work weighed as recipients per donor, most pressed first |
    | `lend_idle_static` | True | static groups waiting for input lend their idle GPUs too |
    | `default_horizon_s` | 30.0 | the rollout's remaining time, and the pipeline's work, assumed before anything is known |
    | `max_horizon_s` | 600.0 | cap on the rollout's estimated remaining time |
    | `n_minibatches` | 8 | trainer mini-batches per iteration (the job spec fills it): one drains after the rollout |
    | `rebalance_gain_ratio` | 0.2 | predicted job throughput gain needed to take workers from a group that is not idle (0: never) |
    | `kv_share_prior` | 0.3 | share of a decode step that grows with the running sequences, until the job's own rollout resizes measure it |
    | `replan` | True | re-plan the placement and the base split at iteration boundaries from what the job measured |
    | `colocate` | True | whether a re-plan may switch the job to colocated (off where engines and trainer cannot share a GPU's memory) |
    | `replan_margin` | 0.1 | share of an iteration the other placement (switch included) or a shifted split must save |
    | `bounded_replan_margin` | 0.05 | the same for a shift to the rollout that loses nothing even if the rollout gains nothing from it |
    | `probation_iterations` | 5 | iterations a kind of move that lost time is not made, before one fresh trial |
    """

    name = "dynarl"
    placement = Placement.DISAGGREGATED
    PARAMS = (
        ParamSpec("u_low", 0.2, "utilisation under which a worker counts as idle", minimum=0.0, maximum=1.0),
        ParamSpec(
            "low_fraction_threshold",
            0.5,
            "fraction of a group's workers that must be idle to trigger",
            minimum=0.0,
            maximum=1.0,
        ),
        ParamSpec("sustain_s", 10.0, "seconds the trigger must hold (the signal window counts)", minimum=0.0),
        ParamSpec(
            "cooldown_s", 10.0, "no new move touching a group for this long after its last", minimum=0.0
        ),
        ParamSpec("min_gain_ratio", 0.05, "predicted job throughput gain a move must reach", minimum=0.0),
        ParamSpec("max_candidates", 16, "shrink candidates weighed per donor", minimum=1),
        ParamSpec("max_recipients", 3, "groups with queued work weighed as recipients per donor", minimum=1),
        ParamSpec("lend_idle_static", True, "static groups waiting for input lend their idle GPUs too"),
        ParamSpec(
            "default_horizon_s",
            30.0,
            "the rollout's remaining time, and the pipeline's work, assumed before anything is known",
            minimum=0.0,
            exclusive_minimum=True,
        ),
        ParamSpec(
            "max_horizon_s",
            600.0,
            "cap on the rollout's estimated remaining time",
            minimum=0.0,
            exclusive_minimum=True,
        ),
        ParamSpec("n_minibatches", 8, "trainer mini-batches per iteration", minimum=1),
        ParamSpec(
            "rebalance_gain_ratio",
            0.2,
            "predicted job throughput gain needed to take workers from a group that is not idle (0: never)",
            minimum=0.0,
        ),
        ParamSpec(
            "kv_share_prior",
            0.3,
            "share of a decode step that grows with the running sequences, until the job's moves measure it",
            minimum=0.0,
            maximum=1.0,
        ),
        ParamSpec(
            "replan",
            True,
            "at iteration boundaries, switch between disaggregated and colocated placement when "
            "the job's measurements predict the other is faster",
        ),
        ParamSpec(
            "colocate",
            True,
            "whether a re-plan may switch the job to time-sharing every GPU (colocated); off where "
            "the engines and the trainer cannot share a GPU's memory",
        ),
        ParamSpec(
            "replan_margin",
            0.1,
            "share of an iteration the other placement must save, switch included, to switch",
            minimum=0.0,
            maximum=1.0,
        ),
        ParamSpec(
            "bounded_replan_margin",
            0.05,
            "share of an iteration a shifted split must save when it loses nothing even if the "
            "rollout gains nothing from the GPUs it is given (the job's pace noise, not the model's error)",
            minimum=0.0,
            maximum=1.0,
        ),
        ParamSpec(
            "probation_iterations",
            5,
            "iterations a kind of move whose moves lost time is not made, before one fresh trial",
            minimum=1,
        ),
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mode = Placement.DISAGGREGATED  # the placement the job runs now (the spec's, at first)
        self.ledger = IterationLedger(self.param_float("low_fraction_threshold"), self.param_float("u_low"))
        self.replanner = Replanner(
            PlacementModel(self.cost_model, self.param_int("n_minibatches")),
            self.param_float("replan_margin"),
        )
        self.outcomes = MoveOutcomes(self.param_int("probation_iterations"))
        self._rollout_base: int | None = None  # rollout GPUs at the start of a disaggregated iteration
        self._placement_choice: PlacementChoice | None = None  # for the caller to carry out
        self._loans_before_change: list[Loan] = []  # loans a refused placement change gives back
        self._opening_before_change = 0.0  # and the seconds their homecoming then costs
        self.last_replan = ""  # the latest boundary's reasoning, for the decision trail
        self._measured: MeasuredIteration | None = None  # this tick's, from the job's driver
        self._measured_learnt: int | None = None  # the last of the driver's iterations learnt from
        self._idle_note = ""  # why the latest tick moved nothing, for the tick's row
        self._rebase_open: tuple[str, float, float] | None = None  # kind, predicted gain s, s per work
        self._ever_ahead = False  # whether the rollout was ever seen generating ahead of the trainer
        self._iteration = 0
        self._low_since: dict[str, float] = {}
        self.memory = PaceMemory()
        self._rebalance_since: dict[str, float] = {}
        # Groups with queued work, ranked; computed once per tick (and per set of busy groups).
        self._recipient_cache: dict[tuple[frozenset[str], bool], list[HyperNode]] = {}
        self.last_candidates: tuple[Candidate, ...] = ()
        self._plan: list[PendingMove] = []  # legs of a pooled move still to issue, in order

    @property
    def u_low(self) -> float:
        return self.param_float("u_low")

    # -- placement -----------------------------------------------------------------------------

    def plan_initial_split(self, total_gpus: int, groups: Sequence[HyperNode]) -> dict[str, int] | None:
        """The job spec's split with the trainer at its smallest valid size: in a synchronous
        iteration it has nothing to train until the first mini-batch is complete, while the
        rollout and the other GPU groups (log-probs) have work from the first seconds. The
        trainer's other GPUs go to those groups in proportion to what the spec gives them, in
        whole workers; what does not make a whole worker stays with the trainer."""
        if total_gpus <= 0:
            raise ValueError(f"total_gpus must be positive, got {total_gpus}")
        trainers = [g for g in groups if g.kind is ComponentKind.ACTOR and g.gpus > 0]
        takers = [g for g in groups if g.kind is not ComponentKind.ACTOR and g.gpus > 0]
        if not trainers or not any(g.kind is ComponentKind.ROLLOUT for g in takers):
            return None
        split = {g.id: g.gpus for g in groups}
        freed = 0
        for trainer in trainers:
            smallest = _smallest_valid_gpus(trainer)
            if 0 < smallest < trainer.gpus:
                freed += trainer.gpus - smallest
                split[trainer.id] = smallest
        held = sum(g.gpus for g in takers)
        left = freed
        # Non-rollout groups get their share in whole workers, rounded to the nearest; the
        # rollout groups (engines are the smallest workers) take the rest.
        for group in sorted(takers, key=lambda g: g.kind is ComponentKind.ROLLOUT):
            size = group.parallelism.gpus_per_worker
            share = freed * group.gpus / held
            extra = min(left, math.floor(share / size + 0.5) * size)
            extra -= extra % size
            if group.max_workers is not None:
                extra = min(extra, max(0, group.max_workers * size - group.gpus))
            split[group.id] += extra
            left -= extra
        # The rounding remainder: whole workers to the rollout first, then to the others.
        for group in sorted(takers, key=lambda g: g.kind is not ComponentKind.ROLLOUT):
            size = group.parallelism.gpus_per_worker
            while left >= size and (group.max_workers is None or split[group.id] // size < group.max_workers):
                split[group.id] += size
                left -= size
        if left:
            split[trainers[0].id] += left
        return split

    # -- the tick ------------------------------------------------------------------------------

    def decide(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> list[Decision]:
        self._sync(graph, now, free_devices)
        self._iteration = graph.iteration
        self.ledger.observe(graph, signals, now)
        if (switched_s := self.ledger.take_switch_s()) is not None:
            self.replanner.learn_switch(switched_s)
        if time_shared(graph):
            self.mode = Placement.COLOCATED  # the job was placed colocated (its spec, or a switch)
        self._idle_note = ""
        if self.mode is Placement.COLOCATED:
            # Every stage time-shares every GPU: there is nothing to move until the boundary.
            self.last_candidates = ()
            self._idle_note = "placed colocated: every stage time-shares every GPU until the iteration ends"
            return []
        self.memory.observe(graph, signals, now)
        self._ever_ahead = self._ever_ahead or self.memory.batches_ahead(graph.iteration) > 0
        self._track_triggers(graph, signals, now)
        busy = self.pending.busy_groups()
        model = self._model(graph, signals, now)
        self._recipient_cache = {}
        base = model.finish_s()
        self.outcomes.settle(
            now,
            {g: s.tokens_per_s for g, s in signals.items() if g not in busy},
            graph.iteration,
            # In a synchronous iteration a group done with its share hands its GPUs on to the
            # trainer, so having finished sooner is what a move to it gained; in an asynchronous
            # job it waits for the next batch, and the idle window is the move's outcome.
            finished=_finished_groups(graph, signals) if self._synchronous(model) else (),
        )

        considered: list[Candidate] = []
        under_way, leg = self._next_leg(graph, busy, now)
        if under_way:
            self.last_candidates = ()
            if leg is None:
                self._idle_note = "the previous leg of a pooled move has not landed yet"
                return []
            if leg.donor is not None and leg.recipient is not None:
                self.loans.pass_on(leg.donor, leg.recipient, leg.device_ids, now)
            return self._issued([leg], now)
        decision = self._home_to_an_empty_lender(graph, busy, now)
        if decision is None:
            decision = self._home_before_next_batch(graph, signals, model, busy, now)
        if decision is None:
            decision = self._best_return(graph, signals, model, base, busy, now)
        if decision is None:
            decision, considered = self._best_shrink(graph, signals, model, base, busy, now)
        if decision is None:
            # With donors weighed and none taken, only a log-prob backlog that outlasts the
            # rollout may still take workers from a working group.
            decision, candidates = self._best_rebalance(
                graph, signals, model, base, busy, now, backlog_only=bool(considered)
            )
            considered.extend(candidates)
        if decision is None and free_devices:
            decision, candidates = self._grow_into_free(graph, signals, model, base, free_devices, busy, now)
            considered.extend(candidates)
        self.last_candidates = tuple(considered)
        if decision is None:
            self._idle_note = self._why_no_move(considered, signals, now)
            return []
        self._open_outcome(graph, signals, decision, now)
        self._probe_rollout(graph, signals, model, decision, now)
        if decision.reason is Reason.RETURN_BORROWED:
            assert decision.recipient is not None and decision.donor is not None
            self.loans.settle(decision.recipient, decision.donor, decision.device_ids)
        elif decision.donor is not None and decision.recipient is not None:
            self.loans.pass_on(decision.donor, decision.recipient, decision.device_ids, now)
        return self._issued([decision], now)

    @property
    def idle_note(self) -> str:
        return self._idle_note

    def decision_refused(self, decision: Decision, why: str) -> None:
        """Besides the base's bookkeeping: a move's loans go back to how they were before it
        (``LoanBook.pass_on`` the other way: its own GPUs are no longer lent, borrowed ones are
        owed by the donor again, GPUs it was taking home are owed to their group again), its
        predicted gain is not held against anything, and the rest of a pooled move is dropped
        (alone they would leave the recipient at a size it cannot run)."""
        super().decision_refused(decision, why)
        if decision.recipient is not None:
            self.outcomes.cancel(decision.recipient, decision.at)
        lent = decision.reason not in (Reason.RETURN_BORROWED, Reason.REPLAN_BASE_SPLIT)
        if lent and decision.donor is not None and decision.recipient is not None:
            self.loans.pass_on(decision.recipient, decision.donor, decision.device_ids, decision.at)
        self._plan = []

    def _why_no_move(
        self, considered: Sequence[Candidate], signals: Mapping[str, GroupSignals], now: float
    ) -> str:
        """The best move weighed and why it lost; with none weighed, which groups were idle and
        for how long against ``sustain_s``."""
        if considered:
            best = max(considered, key=lambda c: c.score)
            gpus = len(best.device_ids)
            return (
                f"best of {len(considered)} moves weighed, {best.donor or 'free GPUs'} to "
                f"{best.recipient or 'the free pool'} ({gpus} GPU{'' if gpus == 1 else 's'}): "
                f"{best.rejected_because or 'not chosen'}"
            )
        idle = {g: self._sustained_s(g, signals[g], now) for g in sorted(self._low_since) if g in signals}
        if not idle:
            return "no group is idle enough to lend its GPUs"
        held = ", ".join(f"{g} for {s:.1f}s" for g, s in idle.items())
        return (
            f"idle: {held} (sustain_s {self.param_float('sustain_s'):g}s); no move to a group "
            f"waiting for GPUs passed the checks (cooldowns, worker limits, loans due back)"
        )

    def _needs_back(self, donor: HyperNode, model: PaceModel, recipient: HyperNode) -> bool:
        """Whether GPUs taken from ``donor`` are bound to return to it: a synchronous rollout's
        next batch needs them, as does a static group (the trainer) with work left, and so does a
        log-prob group with work still to come that lends them to the rollout (the rollout's
        answers are that work). GPUs a log-prob group gives the trainer stay there: the trainer
        is the last stage, and its GPUs go to the next iteration's rollout."""
        if donor.kind is ComponentKind.ROLLOUT:
            return self._synchronous(model)
        if donor.is_dynamic and recipient.kind is not ComponentKind.ROLLOUT:
            return False
        return model.work_gpu_s.get(donor.id, 0.0) > 0

    def _synchronous(self, model: PaceModel) -> bool:
        """Whether the rollout works on the trainer's own iteration (no batch generated ahead)."""
        return model.batches_ahead == 0

    def _probe_rollout(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        decision: Decision,
        now: float,
    ) -> None:
        """Have the memory measure what a rollout resize does to its requests' decode speed."""
        if model.rollout is None:
            return
        delta = 0
        for group_id, sign in ((decision.donor, -1), (decision.recipient, 1)):
            if group_id in model.rollout_ids:
                delta += sign * len(decision.device_ids)
        if delta == 0:
            return
        chosen = decision.chosen
        cost = chosen.migration_cost_s if chosen is not None else 0.0
        window = max((s.window_s for g, s in signals.items() if g in model.rollout_ids), default=0.0)
        self.memory.note_rollout_resize(model.rollout, model.rollout.gpus + delta, now, cost + window + 1.0)

    def on_iteration_end(
        self, graph: Hypergraph, now: float, signals: Mapping[str, GroupSignals] | None = None
    ) -> list[Decision]:
        """Learn from the iteration that ended and plan the next one (``_replan``): its
        placement, and, disaggregated, its base split. Then every borrowed GPU goes home for the
        next iteration's rollout, unless the rollout is already generating it (asynchronous RL):
        then the ticks weigh each return. Given the signals (live), a return goes only if the
        pace model says it pays for itself at the job's measured migration cost, or if its
        lender has no worker left; the ticks weigh the loans kept (``_best_return``)."""
        self._sync(graph, now)
        self._low_since.clear()
        self._plan = []
        self._iteration = graph.iteration
        self.outcomes.drop_open()
        record = self._close_iteration(graph, now)
        choice = self._replan(graph, record)
        if choice is not None:
            # The whole placement is rebuilt for the next iteration: no loan goes home first.
            # They are kept aside in case the caller cannot carry the change out.
            self._placement_choice = choice
            self._loans_before_change = list(self.loans.loans)
            self.loans.loans.clear()
            return []
        if self.memory.generating_ahead(graph.iteration):
            return []
        if signals is None:
            returns = self._return_loans(graph, now)
        else:
            self.memory.observe(graph, signals, now)
            model = self._model(graph, signals, now)
            base = model.finish_s()

            def worth(move: ReturnMove) -> bool:
                if not move.lender.workers:
                    return True
                candidate = self._score(
                    model, base, _Move(move.borrower, move.lender, move.devices, move.workers), signals
                )
                return candidate.rejected_because is None

            returns = self._return_loans(graph, now, worth)
        return self._issued(self._rebase(graph, record, returns, now), now)

    # -- re-planning at the boundary -----------------------------------------------------------

    def iteration_advanced(self, graph: Hypergraph) -> bool:
        # A job first looked at past its first iteration (ticks that fell behind iterations of a
        # second or two) has a finished iteration its driver timed: that first look is a boundary.
        if self.clock.iteration is None:
            return graph.iteration > 0
        return super().iteration_advanced(graph)

    def observe_iteration(self, measured: MeasuredIteration) -> None:
        """The job's driver measured ``measured``, its latest finished iteration: a boundary that
        closes that iteration learns from it rather than from the ticks."""
        self._measured = measured

    def _close_iteration(self, graph: Hypergraph, now: float) -> IterationRecord | None:
        """The record of the iteration that just ended, learnt from; the ledger starts the next."""
        closing = self.ledger.iteration
        record = self.ledger.close(now, self.ledger.job_gpus_max, self.mode)
        measured = self._measured
        if (
            measured is not None
            # No iteration open: the policy's first look at the job, which learns the latest one.
            and (closing is None or measured.iteration >= closing)
            # Each measurement is learnt once: a boundary that finds the driver's report of the
            # iteration it closes not in yet must not learn the previous one again.
            and (self._measured_learnt is None or measured.iteration > self._measured_learnt)
        ):
            record = measured_record(measured, graph, self.mode)
            self._measured_learnt = measured.iteration
        if record is None and closing is not None and self.param_bool("replan"):
            # Said at every boundary, so the trail never repeats an older iteration's reasoning.
            self.last_replan = (
                f"iteration {closing}: too little of it seen to re-plan from "
                f"({self.ledger.ticks} ticks, {self.ledger.sums['rollout_body_s']:.0f}s of them with the "
                f"rollout generating; iterations shorter than a few ticks are not measured): "
                f"{self.mode} stays"
            )
        if self.mode is Placement.DISAGGREGATED:
            staged = record.stages.get(ComponentKind.ROLLOUT.value) if record is not None else None
            if staged is not None and staged[1] > 0:
                # The rollout's GPUs as the driver timed it (the re-plan keeps it from then on).
                if self._rollout_base is None:
                    self._rollout_base = staged[1]
            elif (home := self._home_gpus(graph, ComponentKind.ROLLOUT)) > 0:
                # What the rollout starts the next iteration with once its loans are home, not
                # the most it held: GPUs it borrowed for a while are another group's.
                self._rollout_base = home
        self.ledger.start(graph.iteration, now)
        if record is None:
            return None
        self.replanner.learn(record)
        if self._rebase_open is not None:
            # What the last re-planned split gained: the iteration's duration at the previous
            # one's pace for its work, against what it took.
            kind, predicted_s, seconds_per_work = self._rebase_open
            self._rebase_open = None
            gained = seconds_per_work * work(record) - record.duration_s
            self.outcomes.record(kind, gained / predicted_s, graph.iteration)
        return record

    def _home_gpus(self, graph: Hypergraph, kind: ComponentKind) -> int:
        """The GPUs the groups of ``kind`` own: what they hold, plus what they lent out, less
        what they borrowed (a GPU in transit on a loan counts for its lender)."""
        ids = {node.id for node in graph.by_kind(kind)}
        held = sum(node.gpus for node in graph.by_kind(kind))
        for loan in self.loans.loans:
            if loan.lender in ids and loan.borrower not in ids:
                held += len(loan.device_ids)
            elif loan.borrower in ids and loan.lender not in ids:
                held -= len(loan.device_ids)
        return held

    def _replan(self, graph: Hypergraph, record: IterationRecord | None) -> PlacementChoice | None:
        """The placement change the next iteration should run under, or None to keep it."""
        if not self.param_bool("replan") or record is None:
            return None
        total = record.total_gpus
        rollout_gpus = self._rollout_base or max(1, round(0.75 * total))
        # Time-sharing runs the stages in turn: a job generating ahead of its trainer
        # (asynchronous RL) would lose its overlap, so it stays disaggregated.
        held = ""
        if self.memory.batches_ahead(graph.iteration) > 0:
            held = "the job generates ahead"
        elif not self.param_bool("colocate"):
            held = "colocated placement is off (policy.params.colocate)"
        trainers = graph.by_kind(ComponentKind.ACTOR)
        trainer_gpus = sum(n.gpus for n in trainers)
        # Colocated, the trainer spans the largest of its valid sizes that fits on the job's GPUs
        # (a batch that does not split over all of them leaves some out of the train step).
        spans = [largest_valid_gpus(node, total) for node in trainers]
        colocated_trainer_gpus = min(spans) if spans and 0 < min(spans) < total else None
        opening = self._opening_s(graph)
        choice = self.replanner.choose(
            self.mode,
            rollout_gpus,
            trainer_gpus,
            allow_colocated=not held,
            held_because=held,
            colocated_trainer_gpus=colocated_trainer_gpus,
            opening_s=opening,
        )
        if choice is None:
            return None
        self.last_replan = choice.detail
        if not choice.changes_from(self.mode):
            return None
        if not self.placement_changes_supported:
            self.last_replan = f"{choice.detail} [not carried out: {PLACEMENT_CHANGE_UNSUPPORTED}]"
            self.replanner.opening_s = opening
            return None
        self._opening_before_change = opening
        return choice

    def _opening_s(self, graph: Hypergraph) -> float:
        """The seconds the next iteration loses at its start, disaggregated, while the rollout's
        lent GPUs come home: each return costs the borrower's release and the rollout's engine
        starts (the returns run side by side), and the rollout's body meanwhile runs on the GPUs
        it kept, so the loss is that cost in the share of its GPUs that were away."""
        home = self._home_gpus(graph, ComponentKind.ROLLOUT)
        if home <= 0:
            return 0.0
        away = 0
        slowest = 0.0
        for rollout in graph.by_kind(ComponentKind.ROLLOUT):
            for move in self.loans.return_moves(graph, lender=rollout.id, keep_a_worker=True):
                gpus = len(move.devices)
                away += gpus
                slowest = max(slowest, migration_cost_s(self.cost_model, move.borrower, move.lender, gpus))
        return slowest * min(1.0, away / home)

    def _rebase(
        self, graph: Hypergraph, record: IterationRecord | None, returns: Sequence[Decision], now: float
    ) -> list[Decision]:
        """The boundary's moves: ``returns``, and the next iteration's base split, disaggregated.
        Whole workers move between the rollout and a pipeline group when the placement model, on
        what the iteration measured, predicts the shifted split at least ``replan_margin``
        faster. An iteration the ticks measured (stages overlapping, drained GPUs lent to the
        pipeline) is weighed against the pipeline group with the most work there (log-probs,
        else the trainer), at every size of shift, including GPUs on their way home to the
        group that gives (a return is then split, the shifted part going to the other group),
        and never leaving the giving pipeline group fewer GPUs than its measured work needed to
        keep pace with the rollout. One whose stages the driver timed one after another is
        weighed against each pipeline group, stage by stage, a worker at a time, and only where
        the saving pays the move back within ``PAYBACK_ITERATIONS`` iterations. Each re-planned
        split is held against the next iteration's measured duration (``MoveOutcomes``)."""
        boundary = list(returns)
        if (
            not self.param_bool("replan")
            or record is None
            or record.placement is not Placement.DISAGGREGATED
            or self.mode is not Placement.DISAGGREGATED
            or self._rollout_base is None
            or self.memory.batches_ahead(graph.iteration) > 0
        ):
            return boundary
        coming_home: dict[str, list[Decision]] = {}
        for decision in returns:
            if decision.recipient is not None:
                coming_home.setdefault(decision.recipient, []).append(decision)

        def present(kind: ComponentKind) -> list[HyperNode]:
            return [n for n in graph.by_kind(kind) if n.workers or n.id in coming_home]

        rollouts = present(ComponentKind.ROLLOUT)
        inference = present(ComponentKind.INFERENCE)
        actors = present(ComponentKind.ACTOR)
        if record.stages:
            partners = [group for group in (*inference, *actors) if group.kind.value in record.stages]
            if len(inference) > 1 or len(actors) > 1:
                return boundary
        else:
            partners = inference or actors
            if len(partners) != 1:
                return boundary
        if len(rollouts) != 1 or not partners:
            return boundary
        rollout = rollouts[0]
        base = self._rollout_base
        model = self.replanner.model
        now_s = model.disaggregated_s(record, base)
        if now_s <= 0:
            return boundary
        returning = {d for decision in returns for d in decision.device_ids}
        margin = self.param_float("replan_margin")
        bounded_margin = self.param_float("bounded_replan_margin")
        best: tuple[float, Decision, str, int, Decision | None] | None = None
        declined: list[str] = []
        for partner in partners:
            for donor, recipient, sign in ((rollout, partner, -1), (partner, rollout, 1)):
                for source, devices, redirected in self._rebase_shifts(
                    graph, record, donor, recipient, coming_home, returning
                ):
                    rollout_after = base + sign * len(devices)
                    if rollout_after <= 0 or rollout_after >= record.total_gpus:
                        continue
                    if record.stages:
                        partner_held = record.stages[partner.kind.value][1]
                        after_s = model.staged_s(
                            record,
                            {
                                ComponentKind.ROLLOUT.value: rollout_after,
                                partner.kind.value: partner_held - sign * len(devices),
                            },
                        )
                    else:
                        after_s = model.disaggregated_s(record, rollout_after)
                    saving = 1.0 - after_s / now_s
                    needed, risk = margin, ""
                    if sign > 0 and self._rollout_gain_is_all_upside(
                        record, partner, base, rollout_after, now_s
                    ):
                        needed = min(margin, bounded_margin)
                        risk = f"; no slower even if the rollout gains nothing, so {needed:.0%} is enough"
                    kind = f"rebase:{move_kind(donor, recipient)}"
                    trust, suspended = self.outcomes.trust(kind, graph.iteration)
                    if (
                        suspended is not None
                        or saving * trust < needed
                        or (best is not None and saving <= best[0])
                    ):
                        continue
                    candidate = self._rebase_candidate(record, source, recipient, devices, saving)
                    saving_s = saving * record.duration_s
                    # A split timed by the driver is weighed against the move's cost: on a real
                    # job a move takes seconds against iterations of seconds. (The ticks' path
                    # has no such check: its iterations run far longer than a move, and the live
                    # sim's move estimates swing with the host's load.)
                    if record.stages and PAYBACK_ITERATIONS * saving_s <= candidate.migration_cost_s:
                        declined.append(
                            f"{len(devices)} GPUs of {donor.id} to {recipient.id} would save {seconds(saving_s)}s an "
                            f"iteration, which does not pay a {candidate.migration_cost_s:.1f}s move back within "
                            f"{PAYBACK_ITERATIONS} iterations"
                        )
                        continue
                    via = f", on their way home from {source.id}" if redirected is not None else ""
                    detail = (
                        f"iteration {record.iteration} measured rollout body {seconds(record.rollout_body_s)}s, tail "
                        f"{seconds(record.rollout_tail_s)}s, pipeline {seconds(record.pipeline_gpu_s)} GPU-s: "
                        f"{len(devices)} GPUs of {donor.id} to {recipient.id} for the next iteration{via} "
                        f"(the rollout on {rollout_after} GPUs instead of {base}; predicted {saving:.0%} faster, "
                        f"{seconds(saving_s)}s an iteration for a {candidate.migration_cost_s:.1f}s move{risk})"
                    )
                    decision = make_decision(
                        self.name,
                        Reason.REPLAN_BASE_SPLIT,
                        detail,
                        donor=source,
                        recipient=recipient,
                        device_ids=[d.id for d in devices],
                        at=now,
                        chosen=candidate,
                        candidates=[candidate],
                    )
                    best = (saving, decision, kind, rollout_after, redirected)
        if best is None:
            if declined:
                note = "; ".join(declined)
                self.last_replan = f"{self.last_replan}; {note}" if self.last_replan else note
            return boundary
        saving, decision, kind, rollout_after, redirected = best
        if redirected is not None:
            shifted = set(decision.device_ids)
            kept = tuple(d for d in redirected.device_ids if d not in shifted)
            boundary = [r for r in boundary if r is not redirected]
            if kept:
                detail = (
                    f"{redirected.detail} ({len(kept)} of them; the other {len(shifted)} go to "
                    f"{decision.recipient}, re-planned below)"
                )
                boundary.append(replace(redirected, device_ids=kept, detail=detail))
        self._rollout_base = rollout_after
        self._rebase_open = (kind, saving * record.duration_s, record.duration_s / max(work(record), 1e-9))
        self.last_replan = f"{self.last_replan}; {decision.detail}" if self.last_replan else decision.detail
        return [*boundary, decision]

    def _rollout_gain_is_all_upside(
        self, record: IterationRecord, partner: HyperNode, base: int, rollout_after: int, now_s: float
    ) -> bool:
        """Whether GPUs shifted from ``partner`` to the rollout cost nothing even if the rollout
        gains nothing from them: the iteration predicted with the rollout's work as long as it
        was and the partner on fewer GPUs is no slower than now. How much more engines shorten
        a rollout depends on how full they run, which the model knows least; what the partner
        loses it measured. Such a shift risks no more than the job's pace noise, so it needs
        ``bounded_replan_margin`` rather than the margin that covers the model's error."""
        model = self.replanner.model
        if record.stages:
            held = record.stages[partner.kind.value][1]
            shifted = rollout_after - base
            worst_s = model.staged_s(
                record, {ComponentKind.ROLLOUT.value: base, partner.kind.value: held - shifted}
            )
        else:
            worst_s = model.disaggregated_s(record, rollout_after, body_gpus=base)
        return worst_s <= now_s

    def _rebase_shifts(
        self,
        graph: Hypergraph,
        record: IterationRecord,
        donor: HyperNode,
        recipient: HyperNode,
        coming_home: Mapping[str, Sequence[Decision]],
        returning: set[str],
    ) -> list[tuple[HyperNode, tuple[Device, ...], Decision | None]]:
        """The shifts of ``_rebase`` from ``donor`` to ``recipient``: (the group the devices
        leave, the devices, the return they are taken from or None)."""
        if record.stages:
            workers = self._smallest_shift(donor, recipient, returning)
            return [] if workers is None else [(donor, devices_of(workers), None)]
        home = {
            node_id: sum(len(r.device_ids) for r in decisions) for node_id, decisions in coming_home.items()
        }
        floor = 0
        if donor.kind is not ComponentKind.ROLLOUT and record.rollout_s > 0:
            # A pipeline group keeps what its measured work needed to keep pace with the rollout.
            floor = math.ceil(busy_gpu_s(record, donor.kind) / record.rollout_s)
        donor_after_return = donor.gpus + home.get(donor.id, 0)
        shifts: list[tuple[HyperNode, tuple[Device, ...], Decision | None]] = [
            (donor, devices_of(workers), None)
            for workers in self._shifts(donor, recipient, returning)
            if donor_after_return - len(devices_of(workers)) >= floor
        ]
        # GPUs on their way home to the donor: the shifted part of a return goes to the recipient.
        for redirected in coming_home.get(donor.id, ()):
            if redirected.donor is None:
                continue
            source = graph.node(redirected.donor)
            wanted = set(redirected.device_ids)
            whole = [w for w in source.workers if all(d.id in wanted for d in w.devices)]
            for count in range(1, len(whole) + 1):
                devices = devices_of(whole[:count])
                if donor_after_return - len(devices) < floor:
                    break
                if (
                    self._valid_after_shift(donor, -len(devices), home)
                    and self._valid_after_shift(recipient, len(devices), home)
                    and receive_problem(recipient, devices) is None
                ):
                    shifts.append((source, devices, redirected))
        return shifts

    @staticmethod
    def _valid_after_shift(node: HyperNode, delta_gpus: int, home: Mapping[str, int]) -> bool:
        """Whether ``node`` runs valid workers with its GPUs after the boundary's returns and a
        shift of ``delta_gpus``."""
        gpus = node.gpus + home.get(node.id, 0) + delta_gpus
        per_worker = node.parallelism.gpus_per_worker
        if gpus <= 0 or gpus % per_worker:
            return False
        workers = gpus // per_worker
        if workers < node.min_workers or (node.max_workers is not None and workers > node.max_workers):
            return False
        return node.parallelism.is_valid_worker_count(workers)

    def _rebase_candidate(
        self,
        record: IterationRecord,
        donor: HyperNode,
        recipient: HyperNode,
        devices: Sequence[Device],
        saving: float,
    ) -> Candidate:
        """A re-planned split as the decision trail shows every move: the groups' throughputs
        before and after from the predictor, the job's from the iteration's measured tokens over
        its measured duration and over the duration the placement model predicts after the
        shift (so the control plane's predictor error holds it to account like any move)."""
        gpus = len(devices)

        def rate(node: HyperNode, held: int) -> float:
            return self.predictor.predict(node.id, node.kind, max(0, held))

        before = record.tokens / record.duration_s if record.duration_s > 0 else 0.0
        after = before / (1.0 - saving) if saving < 1.0 else before
        prediction = Prediction(
            donor_before=rate(donor, donor.gpus),
            donor_after=rate(donor, donor.gpus - gpus),
            recipient_before=rate(recipient, recipient.gpus),
            recipient_after=rate(recipient, recipient.gpus + gpus),
            job_before=before,
            job_after=after,
        )
        return Candidate(
            donor=donor.id,
            recipient=recipient.id,
            device_ids=tuple(d.id for d in devices),
            prediction=prediction,
            migration_cost_s=migration_cost_s(self.cost_model, donor, recipient, gpus),
            score=saving * record.duration_s,
        )

    @staticmethod
    def _shifts(donor: HyperNode, recipient: HyperNode, excluded: set[str]) -> list[tuple[Worker, ...]]:
        """Every shift of whole donor workers, its least used first and none holding a device in
        ``excluded``, that leaves both groups at valid sizes; smallest first."""
        offered = [
            w
            for w in sorted(donor.workers, key=lambda w: (w.utilisation, w.id))
            if not any(d.id in excluded for d in w.devices)
        ]
        return [
            tuple(offered[:count])
            for count in range(1, len(offered) + 1)
            if release_problem(donor, count) is None and _takes(recipient, offered[:count])
        ]

    @staticmethod
    def _smallest_shift(
        donor: HyperNode, recipient: HyperNode, excluded: set[str]
    ) -> tuple[Worker, ...] | None:
        """The fewest whole donor workers, on one node and none of them holding a device in
        ``excluded``, that leave both groups at valid sizes; None when no shift is valid."""
        by_node: dict[str, list[Worker]] = {}
        for worker in sorted(donor.workers, key=lambda w: (w.utilisation, w.id)):
            if not any(d.id in excluded for d in worker.devices):
                by_node.setdefault(worker.node, []).append(worker)
        for count in range(1, len(donor.workers)):
            if release_problem(donor, count) is not None:
                continue
            for node_workers in by_node.values():
                chosen = tuple(node_workers[:count])
                if len(chosen) == count and _takes(recipient, chosen):
                    return chosen
        return None

    def next_placement(self) -> PlacementChoice | None:
        """The placement change decided at the last boundary, handed to the caller once; the
        policy takes it as done (``placement_refused`` undoes that)."""
        choice, self._placement_choice = self._placement_choice, None
        if choice is not None:
            self.mode = choice.placement
            self.ledger.hold()
            # Back to disaggregated, the caller places the job by ``plan_initial_split`` again.
            self._rollout_base = None
        return choice

    @property
    def replan_note(self) -> str:
        return self.last_replan

    def placement_refused(self, choice: PlacementChange, why: str) -> None:
        """The caller could not carry out ``choice``: the job stays as it was."""
        self.loans.loans.extend(self._loans_before_change)
        self._loans_before_change = []
        # The loans go home within the next iteration after all (``_return_loans`` of a tick).
        self.replanner.opening_s = self._opening_before_change
        self.ledger.held = False
        self.mode = (
            Placement.DISAGGREGATED if choice.placement is Placement.COLOCATED else Placement.COLOCATED
        )
        self.last_replan = f"{choice.detail} [not carried out: {why}]"

    # -- triggers ------------------------------------------------------------------------------

    def _track_triggers(self, graph: Hypergraph, signals: Mapping[str, GroupSignals], now: float) -> None:
        threshold = self.param_float("low_fraction_threshold")
        for node in graph.nodes:
            sig = signals.get(node.id)
            idle = sig is not None and (sig.low_utilisation_fraction > threshold or not sig.busy)
            if sig is not None and idle and self._may_lend(node, sig):
                self._low_since.setdefault(node.id, now)
            else:
                self._low_since.pop(node.id, None)

    def _may_lend(self, node: HyperNode, sig: GroupSignals) -> bool:
        """Dynamic groups lend when drained; static ones (with ``lend_idle_static``) only while
        they wait for input with nothing queued."""
        if node.gpus <= 0:
            return False
        if node.is_dynamic:
            return True
        return self.param_bool("lend_idle_static") and sig.queue_length == 0

    def _sustained_s(self, group_id: str, sig: GroupSignals, now: float) -> float:
        """How long the low-utilisation condition has held: the window it was measured over
        (the workers were idle for all of it) plus the ticks it has held since; for a group that
        merely has nothing to do, the ticks since it was first seen so."""
        since = self._low_since.get(group_id)
        if since is None:
            return 0.0
        if sig.low_utilisation_fraction > self.param_float("low_fraction_threshold"):
            return sig.window_s + (now - since)
        # Idle only in the sense of having nothing to do right now: no window vouches for it.
        return now - since

    def _donors(
        self, graph: Hypergraph, signals: Mapping[str, GroupSignals], busy: set[str], now: float
    ) -> list[HyperNode]:
        donors = []
        for node in graph.nodes:
            sig = signals.get(node.id)
            if sig is None or node.id not in self._low_since or node.id in busy:
                continue
            if not movable_at_runtime(node):
                continue
            # A group done with its share of the iteration has nothing its signals could still
            # be settling on: neither the cooldown nor the trigger's sustain holds it back.
            done = self._done_for_the_iteration(graph, signals, node, sig)
            if not done and not self.cooldowns.ready(node.id, now):
                continue
            if not done and self._sustained_s(node.id, sig, now) + 1e-9 < self.param_float("sustain_s"):
                continue
            donors.append(node)
        # Algorithm 1's dynamic donors first, then idle static groups; the most drained first.
        donors.sort(key=lambda n: (not n.is_dynamic, -signals[n.id].low_utilisation_fraction, n.id))
        return donors

    def _done_for_the_iteration(
        self, graph: Hypergraph, signals: Mapping[str, GroupSignals], node: HyperNode, sig: GroupSignals
    ) -> bool:
        """Whether a dynamic group has finished its share of a synchronous iteration on a job
        whose rollout never generated ahead, and the rollout has nothing left either: no new
        work can reach it before the iteration ends, so its idleness is no dip to sit out (the
        trigger's ``sustain_s`` is for those)."""
        if not node.is_dynamic or self._ever_ahead or not self.memory.batch_done:
            return False
        if sig.progress < 1.0 or sig.in_flight or sig.queue_length:
            return False
        for rollout in graph.by_kind(ComponentKind.ROLLOUT):
            rollout_sig = signals.get(rollout.id)
            if rollout_sig is None or rollout_sig.in_flight or rollout_sig.queue_length:
                return False
        return True

    def _recipients(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        busy: set[str],
        now: float,
        exclude: str | None = None,
        past_cooldown: bool = False,
    ) -> list[HyperNode]:
        """Groups with work waiting for more GPUs (``_has_work_waiting``: the bottlenecks), the
        most pressed first: the most remaining work per GPU, as the pace model counts it (queued
        requests per engine for a rollout); at most ``max_recipients``, ``exclude`` left out.
        ``past_cooldown``: a group's cooldown does not hold it back (``_ranked_recipients``)."""
        ranked = self._ranked_recipients(graph, signals, model, busy, now, past_cooldown)
        return [n for n in ranked if n.id != exclude][: self.param_int("max_recipients")]

    def _ranked_recipients(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        busy: set[str],
        now: float,
        past_cooldown: bool = False,
    ) -> list[HyperNode]:
        """``_recipients`` before the cut. ``past_cooldown`` is for GPUs of a donor done with its
        share of a synchronous iteration: they cannot bounce back to it before the iteration
        ends, and the recipient's own cooldown (its signals settling after its last resize) does
        not hold them idle; the gain still has to beat the resize's cost."""
        key = (frozenset(busy), past_cooldown)
        if (cached := self._recipient_cache.get(key)) is not None:
            return cached
        eligible = []
        for node in graph.nodes:
            if node.id in busy or model.gpus.get(node.id, 0) <= 0:
                continue
            sig = signals.get(node.id)
            if sig is None or not _has_work_waiting(node, sig, self.u_low):
                continue
            if not movable_at_runtime(node) or not (past_cooldown or self.cooldowns.ready(node.id, now)):
                continue
            eligible.append(node)

        def pressure(node: HyperNode) -> float:
            # Seconds of remaining work per GPU for a pipeline group, queued requests per worker
            # for a serving group.
            work = model.work_gpu_s.get(node.id)
            if work is not None:
                return work / max(1, model.effective_gpus(node, model.gpus[node.id]))
            return signals[node.id].queue_length / max(1, len(node.workers))

        eligible.sort(key=lambda n: (-pressure(n), n.id))
        self._recipient_cache[key] = eligible
        return eligible

    # -- the pace model -------------------------------------------------------------------------

    def _model(self, graph: Hypergraph, signals: Mapping[str, GroupSignals], now: float) -> PaceModel:
        model = PaceModel(
            graph,
            signals,
            self.predictor,
            self.memory,
            now,
            n_minibatches=self.param_int("n_minibatches"),
            max_horizon_s=self.param_float("max_horizon_s"),
            kv_share_prior=self.param_float("kv_share_prior"),
            # A drained group keeps workers enough to stay out of the busy band: consolidated,
            # its kept workers' utilisation stays under twice U_low.
            max_consolidated_utilisation=min(1.0, 2.0 * self.u_low),
            default_horizon_s=self.param_float("default_horizon_s"),
        )
        if model.rollout is not None and model.rollout.has_work and model.rollout.progress <= 0.0:
            model.rollout_s = max(model.rollout_s, self.param_float("default_horizon_s"))
        return model

    def _score(
        self,
        model: PaceModel,
        base: float,
        move: _Move,
        signals: Mapping[str, GroupSignals],
        *,
        requests_taken_back: int = 0,
    ) -> Candidate:
        """Predicted gain of ``move``: how much earlier the pace model's end comes, net of the
        move's cost (its GPUs in transit, a trainer paused for a state transfer)."""
        return self._score_legs(model, base, (move,), signals, (requests_taken_back,))

    def _score_legs(
        self,
        model: PaceModel,
        base: float,
        legs: Sequence[_Move],
        signals: Mapping[str, GroupSignals],
        requests_taken_back: Sequence[int],
    ) -> Candidate:
        """``_score`` for moves from one or more donors to one recipient, carried out one after
        the other (a pooled move): the gain of all of them landed, net of every leg's cost."""
        recipient = legs[0].recipient
        held = model.gpus
        changes = {recipient.id: held[recipient.id] + sum(leg.gpus for leg in legs)}
        for leg in legs:
            if leg.donor is not None:
                changes[leg.donor.id] = held[leg.donor.id] - leg.gpus
        lost = 0.0
        cost_s = 0.0
        recipient_gpus = held[recipient.id]
        for leg, taken_back in zip(legs, requests_taken_back, strict=True):
            donor = leg.donor
            leg_s = migration_cost_s(
                self.cost_model,
                donor,
                recipient,
                leg.gpus,
                requests_taken_back=taken_back,
                donor_gpus=held[donor.id] if donor else None,
                recipient_gpus=recipient_gpus,
            )
            cost_s += leg_s
            lost += leg.gpus * leg_s
            sizes = [(recipient, recipient_gpus, recipient_gpus + leg.gpus)]
            if donor is not None:
                sizes.append((donor, held[donor.id], held[donor.id] - leg.gpus))
            for node, before, after in sizes:
                if node.strategy is MigrationStrategy.P2P:
                    # The trainer pauses (create-before-destroy still needs a consistent state).
                    pause = self.cost_model.estimate_s(
                        MigrationStrategy.P2P, gpus_moved=leg.gpus, recipient_gpus_after=max(after, 1)
                    )
                    lost += pause * model.effective_gpus(node, min(before, after))
            recipient_gpus += leg.gpus
        arrival = cost_s if recipient.kind is ComponentKind.ROLLOUT else 0.0
        after_s = model.finish_s(changes, lost_gpu_s=lost, rollout_arrival_s=arrival)
        for leg in legs:
            if leg.donor is not None and self._needs_back(leg.donor, model, recipient):
                # The GPUs will have to come back (the next batch of a synchronous rollout, the
                # rest of an idle trainer's iteration, a log-prob group's coming work): the move's
                # cost is paid twice.
                back_s = migration_cost_s(self.cost_model, recipient, leg.donor, leg.gpus)
                after_s += leg.gpus * back_s / max(1, model.total_gpus)
        gain = base - after_s
        prediction = self._prediction(model, base, after_s, legs[0], signals, changes)
        ratio = prediction.gain / prediction.job_before if prediction.job_before > 0 else 0.0
        # What moves of this kind gained on this job so far, against what they were predicted to.
        kind = move_kind(legs[0].donor, recipient)
        trust, suspended = self.outcomes.trust(kind, self._iteration)
        why = None
        if suspended is not None:
            why = suspended
        elif not math.isfinite(after_s) or gain <= 0:
            why = f"migration cost {cost_s:.2f}s outweighs the predicted gain ({gain:+.1f}s)"
        elif ratio * trust < self.param_float("min_gain_ratio"):
            discounted = f" ({trust:.0%} of it, as {kind} moves have paid here)" if trust < 1.0 else ""
            why = (
                f"predicted job gain {ratio:.1%}{discounted} is under min_gain_ratio "
                f"{self.param_float('min_gain_ratio'):.1%}"
            )
        first = legs[0].donor
        device_ids = tuple(d.id for leg in legs for d in leg.devices)
        return Candidate(
            donor=first.id if first else None,
            recipient=recipient.id,
            device_ids=device_ids,
            prediction=prediction,
            migration_cost_s=cost_s,
            score=gain * trust if math.isfinite(gain) else -math.inf,
            rejected_because=why,
        )

    def _open_outcome(
        self, graph: Hypergraph, signals: Mapping[str, GroupSignals], decision: Decision, now: float
    ) -> None:
        """Remember the recipient's throughput the chosen move was predicted to add, to hold it
        against what a signal window measures once the move has landed (``MoveOutcomes``)."""
        chosen = decision.chosen
        if chosen is None or chosen.prediction is None or decision.recipient is None:
            return
        recipient_sig = signals.get(decision.recipient)
        if recipient_sig is None:
            return
        donor = graph.node(decision.donor) if decision.donor is not None else None
        prediction = chosen.prediction
        window = max((s.window_s for s in signals.values()), default=0.0)
        self.outcomes.opened(
            OpenOutcome(
                kind=move_kind(donor, graph.node(decision.recipient)),
                recipient=decision.recipient,
                measured_before=recipient_sig.tokens_per_s,
                predicted_rise=prediction.recipient_after - prediction.recipient_before,
                measure_after=now + chosen.migration_cost_s + window,
                opened_at=now,
            )
        )

    def _prediction(
        self,
        model: PaceModel,
        base: float,
        after_s: float,
        move: _Move,
        signals: Mapping[str, GroupSignals],
        changes: Mapping[str, int],
    ) -> Prediction:
        """Group and job throughputs before and after (tokens/s): the job's is the tokens the
        pace model's span trains over the span."""
        tokens = model.tokens_to_train

        def job(end: float) -> float:
            span = end - model.now
            return tokens / span if span > 0 and math.isfinite(span) and tokens > 0 else 0.0

        def group(node: HyperNode | None, gpus: int) -> float:
            if node is None:
                return 0.0
            if node.kind is ComponentKind.ROLLOUT and model.rollout is not None:
                sig = signals.get(node.id)
                delivered = sig.tokens_per_s if sig is not None and sig.tokens_per_s > 0 else 0.0
                if delivered:
                    # A drained rollout delivers what its stragglers allow, slowed by consolidation.
                    return delivered / consolidation_slowdown(
                        model.rollout,
                        model.rollout.gpus + gpus - model.gpus[node.id],
                        model.kv_share_floor,
                        1.0,
                    )
            return self.predictor.predict(node.id, node.kind, model.effective_gpus(node, gpus))

        donor, recipient = move.donor, move.recipient
        return Prediction(
            donor_before=group(donor, model.gpus[donor.id]) if donor else 0.0,
            donor_after=group(donor, changes[donor.id]) if donor else 0.0,
            recipient_before=group(recipient, model.gpus[recipient.id]),
            recipient_after=group(recipient, changes[recipient.id]),
            job_before=job(base),
            job_after=job(after_s),
        )

    # -- moves ---------------------------------------------------------------------------------

    def _best_shrink(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        base: float,
        busy: set[str],
        now: float,
    ) -> tuple[Decision | None, list[Candidate]]:
        candidates: list[Candidate] = []
        # GPUs a static group lent stay where they are until it takes them back: a trainer's
        # valid data-parallel sizes rarely survive collecting them back from several groups.
        # Offered to that group itself, they are going home.
        pinned = self.loans.lenders_of([n.id for n in graph.nodes if not n.is_dynamic])
        offers: list[tuple[HyperNode, list[Worker]]] = []
        single_reach: dict[str, int] = {}  # recipient -> most GPUs one donor can give it validly
        bundled: dict[tuple[str, str], list[tuple[Worker, ...]]] = {}  # (donor, recipient) -> bundles
        done: set[str] = set()  # donors done with their share of a synchronous iteration
        for donor in self._donors(graph, signals, busy, now):
            sig = signals[donor.id]
            if self._done_for_the_iteration(graph, signals, donor, sig):
                done.add(donor.id)
            by_id: dict[str, Worker] = {w.id: w for w in donor.workers}
            # A group with nothing at all to do offers every worker, not only those the window saw idle.
            offered_ids = (
                list(by_id) if not sig.busy else [w for w in sig.low_utilisation_workers if w in by_id]
            )
            idle = [by_id[w] for w in offered_ids]
            if not idle:
                continue
            offers.append((donor, idle))
            recipients = self._recipients(
                graph,
                signals,
                model,
                busy,
                now,
                exclude=donor.id,
                past_cooldown=donor.id in done,
            )
            if not recipients:
                continue
            per_recipient = max(1, self.param_int("max_candidates") // len(recipients))
            for recipient in recipients:
                free_to_go = _offered_to(recipient, idle, pinned)
                if not free_to_go:
                    continue
                offered = bundled.setdefault((donor.id, recipient.id), bundles(recipient, free_to_go))
                valid, problem = _valid_prefixes(donor, recipient, offered)
                if not valid:
                    candidates.append(
                        _rejected(donor, recipient, free_to_go, problem or "no whole workers to move")
                    )
                    continue
                reach = sum(len(w.devices) for w in valid[-1])
                single_reach[recipient.id] = max(single_reach.get(recipient.id, 0), reach)
                for prefix in _spread(valid, per_recipient):
                    taken_back = math.ceil(sig.in_flight * len(prefix) / max(len(donor.workers), 1))
                    move = _Move(donor, recipient, devices_of(prefix), prefix)
                    candidates.append(self._score(model, base, move, signals, requests_taken_back=taken_back))
        pooled: dict[tuple[str, ...], list[_Move]] = {}
        candidates.extend(
            self._pooled_candidates(
                offers, graph, signals, model, base, busy, now, pooled, single_reach, bundled, pinned, done
            )
        )
        decision, marked = self._choose(
            candidates,
            Reason.DONOR_LOW_UTILISATION,
            lambda c: self._shrink_detail(c, signals, now, pooled.get(c.device_ids)),
            graph,
            now,
        )
        if decision is not None and decision.chosen is not None and decision.chosen.device_ids in pooled:
            decision = self._start_pooled(decision, pooled[decision.chosen.device_ids], now)
        return decision, marked

    def _pooled_candidates(
        self,
        offers: Sequence[tuple[HyperNode, list[Worker]]],
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        base: float,
        busy: set[str],
        now: float,
        legs_of: dict[tuple[str, ...], list[_Move]],
        single_reach: Mapping[str, int],
        bundled: dict[tuple[str, str], list[tuple[Worker, ...]]],
        pinned: Mapping[str, str],
        done: Collection[str] = (),
    ) -> list[Candidate]:
        """Shrink candidates that pool the idle workers of several donors: a recipient whose valid
        sizes are far apart (a trainer's data-parallel sizes are powers of two) may reach the next
        one only with GPUs from more than one drained group, e.g. a finished rollout's engines
        and an idle log-prob group. The idle workers of the first ``POOL_MAX_DONORS`` donors with
        any to offer the recipient are taken in the donors' order, whole bundles at a time; a
        prefix is a candidate when it spans two donors and leaves the recipient at a valid size
        larger than any single donor can give it (``single_reach``): a smaller pooled move would
        only cost more migrations than a single donor's. ``legs_of`` maps a candidate's devices to its legs; ``bundled``
        caches each (donor, recipient) pair's bundles; ``pinned`` maps devices a static group
        lent to that group, the only recipient they go to. ``done``: the donors done with their
        share of a synchronous iteration; when every donor offering is one of them, the
        recipients' cooldowns do not hold the pool back (as for each of them alone,
        ``_ranked_recipients``)."""
        if len(offers) < 2:
            return []
        donors = {donor.id: donor for donor, _ in offers}
        candidates: list[Candidate] = []
        pooled_done = all(donor.id in done for donor, _ in offers)
        recipients = [
            n
            for n in self._ranked_recipients(graph, signals, model, busy, now, past_cooldown=pooled_done)
            if n.id not in donors
        ][: self.param_int("max_recipients")]
        for recipient in recipients:
            per_worker = recipient.parallelism.gpus_per_worker
            taken: dict[str, list[Worker]] = {}
            unable: set[str] = set()  # donors that cannot give what is taken from them so far
            gpus = 0
            prefixes: list[dict[str, tuple[Worker, ...]]] = []
            pool = [
                (donor, free_to_go)
                for donor, idle in offers
                if (free_to_go := _offered_to(recipient, idle, pinned))
            ]
            # Two donors at most: each is a migration of its own, carried out one after the other.
            for donor, free_to_go in pool[:POOL_MAX_DONORS]:
                refused = False
                offered = bundled.get((donor.id, recipient.id))
                if offered is None:
                    offered = bundled.setdefault((donor.id, recipient.id), bundles(recipient, free_to_go))
                for bundle in offered:
                    if any(not recipient.accepts_hardware(d.hardware) for w in bundle for d in w.devices):
                        refused = True
                        break
                    taken.setdefault(donor.id, []).extend(bundle)
                    gpus += sum(len(w.devices) for w in bundle)
                    after = len(recipient.workers) + gpus // per_worker
                    if recipient.max_workers is not None and after > recipient.max_workers:
                        refused = True
                        break
                    if release_problem(donor, len(taken[donor.id])) is None:
                        unable.discard(donor.id)
                    else:
                        unable.add(donor.id)
                    if len(taken) < 2 or unable or gpus <= single_reach.get(recipient.id, 0):
                        continue
                    if recipient.is_valid_worker_count(after):
                        prefixes.append({g: tuple(ws) for g, ws in taken.items()})
                if refused:
                    break
            per_recipient = max(1, self.param_int("max_candidates") // len(recipients))
            for prefix in _spread(prefixes, per_recipient):
                legs = [_Move(donors[g], recipient, devices_of(ws), ws) for g, ws in prefix.items()]
                taken_back = [
                    math.ceil(
                        signals[leg.donor.id].in_flight * len(leg.workers) / max(len(leg.donor.workers), 1)
                    )
                    for leg in legs
                    if leg.donor is not None
                ]
                candidate = self._score_legs(model, base, legs, signals, taken_back)
                legs_of[candidate.device_ids] = legs
                candidates.append(candidate)
        return candidates

    def _start_pooled(self, decision: Decision, legs: Sequence[_Move], now: float) -> Decision:
        """Issue a pooled move's first leg now; the others follow, one per tick, as each lands
        (a job runs one migration at a time)."""
        first, rest = legs[0], legs[1:]
        self._plan = [
            PendingMove(
                leg.donor.id if leg.donor else None, leg.recipient.id, tuple(d.id for d in leg.devices), now
            )
            for leg in rest
        ]
        return replace(decision, device_ids=tuple(d.id for d in first.devices))

    def _next_leg(self, graph: Hypergraph, busy: set[str], now: float) -> tuple[bool, Decision | None]:
        """(whether a pooled move is under way, its next leg if it can go now). A plan is dropped
        when its devices changed hands meanwhile or it outlived the pending-move timeout."""
        if not self._plan:
            return False, None
        leg = self._plan[0]
        try:
            donor = graph.node(leg.donor) if leg.donor else None
            recipient = graph.node(leg.recipient) if leg.recipient else None
        except KeyError:
            donor = recipient = None
        stale = now - leg.at > self.PENDING_TIMEOUT_S
        if (
            recipient is None
            or stale
            or (donor is not None and not set(leg.device_ids) <= set(donor.device_ids))
        ):
            self._plan = []
            return False, None
        if leg.recipient in busy or (leg.donor is not None and leg.donor in busy):
            return True, None
        self._plan = self._plan[1:]
        left = f", {len(self._plan)} more to come" if self._plan else ""
        return True, make_decision(
            self.name,
            Reason.DONOR_LOW_UTILISATION,
            f"pooled move, next leg: {len(leg.device_ids)} GPUs of {leg.donor} to {leg.recipient}{left}",
            donor=donor,
            recipient=recipient,
            device_ids=leg.device_ids,
            at=now,
        )

    def _best_rebalance(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        base: float,
        busy: set[str],
        now: float,
        *,
        backlog_only: bool = False,
    ) -> tuple[Decision | None, list[Candidate]]:
        """Pace rebalancing: when no group is idle enough for Algorithm 1 but the pace model
        shows one stage holding the job back (e.g. a rollout that fell behind in asynchronous
        RL, or a trainer whose input piles up), a group with slack gives it workers, its least
        used first. Only a predicted gain of ``rebalance_gain_ratio`` sustained for
        ``sustain_s`` moves anything: these donors are working."""
        threshold = self.param_float("rebalance_gain_ratio")
        if threshold <= 0:
            self._rebalance_since.clear()
            return None, []
        candidates: list[Candidate] = []
        # Only a rollout with requests waiting for a slot is short of capacity for certain, and
        # a log-prob group whose queue alone outlasts the rollout of a synchronous iteration (it
        # paces the iteration's end whatever the rollout does); the rest of the pipeline trades
        # GPUs through Algorithm 1 as groups go idle.
        recipients = [
            n
            for n in self._recipients(graph, signals, model, busy, now)
            if (n.kind is ComponentKind.ROLLOUT and not backlog_only)
            or self._backlog_outlasts_rollout(n, signals, model)
        ]
        per_pair = max(1, self.param_int("max_candidates") // max(1, len(recipients)))
        for recipient in recipients:
            for donor in graph.nodes:
                if donor.id == recipient.id or model.gpus.get(donor.id, 0) <= 0 or donor.id in busy:
                    continue
                sig = signals.get(donor.id)
                if sig is None or not movable_at_runtime(donor) or not self.cooldowns.ready(donor.id, now):
                    continue
                if sig.queue_length > 0 and donor.kind is recipient.kind:
                    continue
                offered = _least_used_first(donor, sig)
                valid, _ = _valid_prefixes(donor, recipient, bundles(recipient, offered))
                for prefix in _spread(valid, per_pair):
                    taken_back = math.ceil(sig.in_flight * len(prefix) / max(len(donor.workers), 1))
                    move = _Move(donor, recipient, devices_of(prefix), prefix)
                    candidate = self._score(model, base, move, signals, requests_taken_back=taken_back)
                    prediction = candidate.prediction
                    if (
                        candidate.rejected_because is None
                        and prediction is not None
                        and prediction.job_before > 0
                        and prediction.gain / prediction.job_before < threshold
                    ):
                        candidate = replace(
                            candidate,
                            rejected_because=f"a working donor needs a predicted gain of {threshold:.0%}",
                        )
                    candidates.append(candidate)
        viable = {f"{c.donor}>{c.recipient}" for c in candidates if c.rejected_because is None}
        rollout_ids = {n.id for n in graph.by_kind(ComponentKind.ROLLOUT)}
        for key in list(self._rebalance_since):
            # A pass that weighed only log-prob backlogs says nothing of a rollout's imbalance.
            if key not in viable and not (backlog_only and key.partition(">")[2] in rollout_ids):
                del self._rebalance_since[key]
        ready: list[Candidate] = []
        for candidate in candidates:
            if candidate.rejected_because is not None:
                ready.append(candidate)
                continue
            # No window vouches for an imbalance: it must be seen for sustain_s of ticks.
            since = self._rebalance_since.setdefault(f"{candidate.donor}>{candidate.recipient}", now)
            if now - since + 1e-9 < self.param_float("sustain_s"):
                candidate = replace(
                    candidate, rejected_because="the imbalance has not held for sustain_s yet"
                )
            ready.append(candidate)
        decision, marked = self._choose(
            ready,
            Reason.BORROW_IDLE_POOL,
            lambda c: self._rebalance_detail(c),
            graph,
            now,
        )
        if decision is not None:
            self._rebalance_since.clear()
        return decision, marked

    def _backlog_outlasts_rollout(
        self, node: HyperNode, signals: Mapping[str, GroupSignals], model: PaceModel
    ) -> bool:
        sig = signals.get(node.id)
        if (
            node.kind is not ComponentKind.INFERENCE
            or sig is None
            or sig.queue_length <= 0
            or model.rollout is None
            or not model.rollout.has_work
            or not self._synchronous(model)
            # The rollout's remaining time is a guess until a whole batch has been seen, and the
            # log-prob group's work is mostly still to come until most of the batch is generated.
            or self.memory.previous_duration_s is None
            or model.rollout.progress < BACKLOG_FROM_PROGRESS
        ):
            return False
        held = model.effective_gpus(node, model.gpus.get(node.id, 0))
        return held > 0 and model.work_gpu_s.get(node.id, 0.0) / held > model.rollout_s

    @staticmethod
    def _rebalance_detail(chosen: Candidate) -> str:
        gain = ""
        if chosen.prediction is not None and chosen.prediction.job_before > 0:
            gain = f" (predicted job throughput {chosen.prediction.job_after / chosen.prediction.job_before - 1:+.0%})"
        return f"{chosen.recipient} paces the job: {len(chosen.device_ids)} GPUs of {chosen.donor}{gain}"

    def _shrink_detail(
        self,
        chosen: Candidate,
        signals: Mapping[str, GroupSignals],
        now: float,
        legs: Sequence[_Move] | None = None,
    ) -> str:
        assert chosen.donor is not None
        if legs:
            parts = ", then ".join(f"{leg.gpus} of {leg.donor.id if leg.donor else 'free'}" for leg in legs)
            predicted = ""
            if chosen.prediction is not None and chosen.prediction.job_before > 0:
                predicted = f" (predicted job throughput {chosen.prediction.job_after / chosen.prediction.job_before - 1:+.0%})"
            return (
                f"drained groups pool their idle GPUs so {chosen.recipient} reaches a valid size: "
                f"{parts} to {chosen.recipient}{predicted}"
            )
        sig = signals[chosen.donor]
        share = f"{sig.low_utilisation_fraction:.0%} of {chosen.donor}'s workers under u_low={self.u_low}"
        if not sig.busy:
            share = f"{chosen.donor} has nothing to do"
        predicted = ""
        if chosen.prediction is not None and chosen.prediction.job_before > 0:
            predicted = f" (predicted job throughput {chosen.prediction.job_after / chosen.prediction.job_before - 1:+.0%})"
        return (
            f"{share} for {self._sustained_s(chosen.donor, sig, now):.0f}s: "
            f"{len(chosen.device_ids)} GPUs to {chosen.recipient}{predicted}"
        )

    def _home_to_an_empty_lender(self, graph: Hypergraph, busy: set[str], now: float) -> Decision | None:
        """GPUs lent in an earlier iteration by a group left without workers go home as soon as
        the borrower holds them: the iteration-end returns skip a loan still in transit at the
        boundary, and a group without workers shows no queue for a return to answer."""
        for loan in sorted(self.loans.loans, key=lambda item: (item.lender, item.borrower)):
            if loan.at >= self.clock.started_at or loan.lender in busy or loan.borrower in busy:
                continue
            try:
                lender = graph.node(loan.lender)
            except KeyError:
                continue
            if lender.workers:
                continue
            for move in self.loans.return_moves(graph, lender=loan.lender, borrower=loan.borrower):
                if not movable_between_iterations(move.borrower):
                    continue
                return self._return_decision(
                    move,
                    f"{loan.lender} has no worker left in iteration {graph.iteration}: {loan.borrower} "
                    f"returns {len(move.devices)} GPUs it borrowed in an earlier iteration",
                    now,
                )
        return None

    def _home_before_next_batch(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        busy: set[str],
        now: float,
    ) -> Decision | None:
        """Once a synchronous rollout has finished its batch, GPUs it lent to a group that has
        finished its share of the iteration and idles go home at once: the next batch comes with the next iteration, and
        engines already up take it in one wave instead of leaving it to the few that stayed."""
        if not self._synchronous(model) or not self.memory.batch_done:
            return None
        for loan in sorted(self.loans.loans, key=lambda item: (item.lender, item.borrower)):
            lender_id, borrower_id = loan.lender, loan.borrower
            if lender_id not in model.rollout_ids or lender_id in busy or borrower_id in busy:
                continue
            sig = signals.get(borrower_id)
            # Done with this iteration's work (not merely between two pieces of it) and idle.
            if sig is None or sig.progress < 1.0 or borrower_id not in self._low_since:
                continue
            if self._sustained_s(borrower_id, sig, now) + 1e-9 < self.param_float("sustain_s"):
                continue
            waiting = {node.id for node in self._ranked_recipients(graph, signals, model, busy, now)}
            if not self._ever_ahead and any(
                node.id not in (lender_id, borrower_id)
                and not node.is_dynamic
                and (node.id in waiting or _started_work(signals.get(node.id)))
                for node in graph.nodes
            ):
                # The trainer has work waiting for GPUs and the next batch cannot start before it
                # is done (the rollout never generated ahead on this job): the borrower passes the
                # GPUs on to it (``_best_shrink``) rather than sending them home to wait. A
                # trainer that has just started its last mini-batch counts before its windowed
                # utilisation shows it: a return now would hold both groups in their cooldown
                # while it trains on the GPUs it has.
                continue
            for move in self.loans.return_moves(graph, lender=lender_id, borrower=borrower_id):
                if not movable_at_runtime(move.borrower):
                    continue
                return self._return_decision(
                    move,
                    f"{lender_id} finished its batch and {borrower_id} is idle: {len(move.devices)} "
                    f"borrowed GPUs go home before the next batch",
                    now,
                )
        return None

    def _best_return(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        base: float,
        busy: set[str],
        now: float,
    ) -> Decision | None:
        """Borrowed GPUs go back when their group has work queued again and the pace model says
        the job gains from it (the lender has become the bottleneck)."""
        best: tuple[Candidate, HyperNode, HyperNode] | None = None
        for lender_id in sorted({loan.lender for loan in self.loans.loans}):
            sig = signals.get(lender_id)
            # A lender without workers reports no queue; the pace model sees whether it has work.
            if (
                sig is None
                or lender_id in busy
                or (sig.queue_length <= 0 and model.gpus.get(lender_id, 0) > 0)
            ):
                continue
            try:
                lender = graph.node(lender_id)
            except KeyError:
                continue
            for move in self.loans.return_moves(graph, lender=lender_id):
                if move.borrower.id in busy:
                    continue
                candidate = self._score(
                    model, base, _Move(move.borrower, lender, move.devices, move.workers), signals
                )
                if candidate.rejected_because is None and (best is None or candidate.score > best[0].score):
                    best = (candidate, move.borrower, lender)
        if best is None:
            return None
        candidate, borrower, lender = best
        return make_decision(
            self.name,
            Reason.RETURN_BORROWED,
            f"{lender.id} has work again (queue {signals[lender.id].queue_length}) and is the bottleneck: "
            f"{borrower.id} returns {len(candidate.device_ids)} GPUs",
            donor=borrower,
            recipient=lender,
            device_ids=candidate.device_ids,
            at=now,
            chosen=candidate,
            candidates=[candidate],
        )

    def _grow_into_free(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        model: PaceModel,
        base: float,
        free_devices: Sequence[Device],
        busy: set[str],
        now: float,
    ) -> tuple[Decision | None, list[Candidate]]:
        candidates: list[Candidate] = []
        for recipient in self._recipients(graph, signals, model, busy, now)[:1]:
            steps = valid_growth_steps(recipient, len(free_devices))
            for gpus in _spread(steps, self.param_int("max_candidates")):
                devices = pick_free_devices(recipient, free_devices, gpus)
                if devices is None:
                    continue
                problem = receive_problem(recipient, devices)
                if problem is not None:
                    candidates.append(
                        Candidate(None, recipient.id, tuple(d.id for d in devices), None, 0.0, 0.0, problem)
                    )
                    continue
                candidates.append(self._score(model, base, _Move(None, recipient, devices), signals))
        return self._choose(
            candidates,
            Reason.GROW_INTO_FREE_DEVICES,
            lambda c: f"{len(c.device_ids)} free GPUs to the bottleneck {c.recipient}",
            graph,
            now,
        )

    def _choose(
        self,
        candidates: list[Candidate],
        reason: Reason,
        detail: Any,
        graph: Hypergraph,
        now: float,
    ) -> tuple[Decision | None, list[Candidate]]:
        viable = [c for c in candidates if c.rejected_because is None]
        if not viable:
            return None, candidates
        best = max(viable, key=lambda c: (c.score, -len(c.device_ids)))
        marked = [
            c if c is best or c.rejected_because else replace(c, rejected_because=NOT_BEST)
            for c in candidates
        ]
        donor = graph.node(best.donor) if best.donor else None
        recipient = graph.node(best.recipient) if best.recipient else None
        decision = make_decision(
            self.name,
            reason,
            detail(best),
            donor=donor,
            recipient=recipient,
            device_ids=best.device_ids,
            at=now,
            chosen=best,
            candidates=marked,
        )
        return decision, marked

    # -- state ---------------------------------------------------------------------------------

    def state_to_json(self) -> dict[str, Any]:
        return {
            **super().state_to_json(),
            "low_since": dict(self._low_since),
            "rebalance_since": dict(self._rebalance_since),
            "pace": self.memory.to_json(),
            "plan": [leg.to_json() for leg in self._plan],
            "mode": self.mode.value,
            "ledger": self.ledger.to_json(),
            "replanner": self.replanner.to_json(),
            "outcomes": self.outcomes.to_json(),
            "rollout_base": self._rollout_base,
            "last_replan": self.last_replan,
            "rebase_open": list(self._rebase_open) if self._rebase_open is not None else None,
            "ever_ahead": self._ever_ahead,
            "measured_learnt": self._measured_learnt,
        }

    def load_state(self, data: Mapping[str, Any]) -> None:
        super().load_state(data)
        self._low_since = {k: float(v) for k, v in data.get("low_since", {}).items()}
        self._rebalance_since = {k: float(v) for k, v in data.get("rebalance_since", {}).items()}
        self.memory = PaceMemory()
        self.memory.load(data.get("pace", {}))
        self._plan = [PendingMove.from_json(item) for item in data.get("plan", [])]
        self.mode = Placement(data.get("mode", Placement.DISAGGREGATED.value))
        self.ledger.load(data.get("ledger", {}))
        self.replanner.load(data.get("replanner", {}))
        self.outcomes.load(data.get("outcomes", {}))
        base = data.get("rollout_base")
        self._rollout_base = None if base is None else int(base)
        self.last_replan = str(data.get("last_replan", ""))
        self._ever_ahead = bool(data.get("ever_ahead", False))
        learnt = data.get("measured_learnt")
        self._measured_learnt = None if learnt is None else int(learnt)
        rebase = data.get("rebase_open")
        self._rebase_open = (str(rebase[0]), float(rebase[1]), float(rebase[2])) if rebase else None


def _smallest_valid_gpus(node: HyperNode) -> int:
    """GPUs of the group's smallest valid worker count (at least its minimum, at least one)."""
    workers = max(1, node.min_workers)
    limit = len(node.workers) if node.workers else workers
    while workers <= limit and not node.is_valid_worker_count(workers):
        workers += 1
    if workers > limit:
        return node.gpus
    return largest_valid_gpus(node, workers * node.parallelism.gpus_per_worker)


def _takes(recipient: HyperNode, workers: Sequence[Worker]) -> bool:
    """Whether ``recipient`` can take the devices of ``workers`` as whole workers of its own
    and stay at a valid size."""
    per_worker = recipient.parallelism.gpus_per_worker
    gpus = sum(len(w.devices) for w in workers)
    if gpus <= 0 or gpus % per_worker:
        return False
    after = len(recipient.workers) + gpus // per_worker
    if recipient.max_workers is not None and after > recipient.max_workers:
        return False
    return recipient.is_valid_worker_count(after) and receive_problem(recipient, devices_of(workers)) is None


def _finished_groups(graph: Hypergraph, signals: Mapping[str, GroupSignals]) -> set[str]:
    """Groups with no GPUs left, or done with their share of the iteration and nothing queued."""

    def done(sig: GroupSignals | None) -> bool:
        return sig is not None and sig.progress >= 1.0 - 1e-9 and sig.queue_length == 0 and sig.in_flight == 0

    return {node.id for node in graph.nodes if node.gpus <= 0 or done(signals.get(node.id))}


def _has_work_waiting(node: HyperNode, sig: GroupSignals, u_low: float) -> bool:
    """Whether more GPUs would be used at once: requests or data queued for the group, or, for a
    static group (the trainer, whose throughput grows with its GPUs), work running on workers
    that are not idle."""
    if sig.queue_length > 0:
        return True
    return not node.is_dynamic and sig.in_flight > 0 and sig.utilisation_p50 >= u_low


def _started_work(sig: GroupSignals | None) -> bool:
    """Whether the group has work on its workers or queued for them, as of its latest samples
    (not its window's utilisation, which lags a start by up to a window)."""
    return sig is not None and (sig.in_flight > 0 or sig.queue_length > 0)


def _offered_to(recipient: HyperNode, workers: Sequence[Worker], pinned: Mapping[str, str]) -> list[Worker]:
    """The ``workers`` a shrink move may give ``recipient``: none holding a device that
    ``pinned`` says another group lent (it waits to take them back), and those holding the
    recipient's own last, so that a move takes them only when it needs more than the rest."""
    lenders = [{pinned[d.id] for d in w.devices if d.id in pinned} for w in workers]
    others = [w for w, lent_by in zip(workers, lenders, strict=True) if not lent_by]
    own = [w for w, lent_by in zip(workers, lenders, strict=True) if lent_by == {recipient.id}]
    return others + own


def _least_used_first(node: HyperNode, sig: GroupSignals) -> list[Worker]:
    """The group's workers, those the window saw under U_low first (lowest first), then the rest
    by their latest utilisation."""
    by_id = {w.id: w for w in node.workers}
    low = [by_id[w] for w in sig.low_utilisation_workers if w in by_id]
    seen = {w.id for w in low}
    rest = sorted((w for w in node.workers if w.id not in seen), key=lambda w: (w.utilisation, w.id))
    return low + rest


def _rejected(
    donor: HyperNode, recipient: HyperNode | None, workers: Sequence[Worker], why: str
) -> Candidate:
    return Candidate(
        donor=donor.id,
        recipient=recipient.id if recipient else None,
        device_ids=tuple(d.id for d in devices_of(workers)),
        prediction=None,
        migration_cost_s=0.0,
        score=0.0,
        rejected_because=why,
    )


def _valid_prefixes(
    donor: HyperNode, recipient: HyperNode, offered: Sequence[tuple[Worker, ...]]
) -> tuple[list[tuple[Worker, ...]], str | None]:
    """Prefixes of ``offered`` bundles that both groups can run with, and, when there is none,
    why the smallest one fails. Bundles already make whole same-node recipient workers, so
    only hardware and worker counts are left to check, incrementally."""
    valid: list[tuple[Worker, ...]] = []
    first_problem: str | None = None
    workers: list[Worker] = []
    gpus = 0
    per_worker = recipient.parallelism.gpus_per_worker
    for bundle in offered:
        refused = sorted(
            {d.hardware for w in bundle for d in w.devices if not recipient.accepts_hardware(d.hardware)}
        )
        if refused:
            first_problem = first_problem or f"{recipient.id} does not run on {', '.join(refused)}"
            break  # every longer prefix holds this bundle too
        workers.extend(bundle)
        gpus += sum(len(w.devices) for w in bundle)
        problem = release_problem(donor, len(workers))
        if problem is None:
            after = len(recipient.workers) + gpus // per_worker
            if recipient.max_workers is not None and after > recipient.max_workers:
                first_problem = first_problem or (
                    f"{recipient.id} would grow to {after} workers, over its maximum {recipient.max_workers}"
                )
                break
            if not recipient.is_valid_worker_count(after):
                problem = f"{recipient.id} cannot run {after} workers (valid: {list(recipient.parallelism.valid_dp)})"
        if problem is None:
            valid.append(tuple(workers))
        else:
            first_problem = first_problem or problem
    return valid, first_problem


def _spread(values: Sequence[_T], limit: int) -> list[_T]:
    """At most ``limit`` of ``values``, evenly spread, in order, always including the last."""
    if len(values) <= limit:
        return list(values)
    if limit == 1:
        return [values[-1]]
    step = (len(values) - 1) / (limit - 1)
    picked = sorted({round(i * step) for i in range(limit)})
    return [values[i] for i in picked]
