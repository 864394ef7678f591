"""BiDiRL: a balanced rollout / training split, then bidirectional borrowing of idle GPUs."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.core.decisions import Decision, Reason
from scheduler.core.hypergraph import ComponentKind, Device, Hypergraph, HyperNode, Worker
from scheduler.core.policies.base import BasePolicy, Placement
from scheduler.core.policies.moves import (
    apply_move,
    devices_of,
    largest_valid_transfer,
    make_decision,
    migration_cost_s,
    movable_at_runtime,
)
from scheduler.core.policies.params import ParamSpec
from scheduler.core.predictor import ThroughputPredictor
from scheduler.core.signals import GroupSignals

ROLLOUT_POOL_KINDS = frozenset({ComponentKind.ROLLOUT})
# Tool environments are CPU processes; a reward group joins the training pool only if it holds GPUs.
CPU_SIDE_KINDS = frozenset({ComponentKind.TOOL})


@dataclass(frozen=True)
class SplitPlan:
    gpus: dict[str, int]
    rollout_s_per_token: float
    training_s_per_token: float


def _size_options(node: HyperNode, total_gpus: int) -> list[int]:
    """GPU counts the group can run with (whole workers, valid sizes) within ``total_gpus``."""
    per_worker = node.parallelism.gpus_per_worker
    most = total_gpus // per_worker
    if node.max_workers is not None:
        most = min(most, node.max_workers)
    return [n * per_worker for n in range(node.min_workers, most + 1) if node.is_valid_worker_count(n)]


def plan_split(predictor: ThroughputPredictor, total_gpus: int, groups: Sequence[HyperNode]) -> SplitPlan:
    """The time-performance planner: choose every group's GPUs so the iteration's rollout time
    and training time are as short, and so as balanced, as the sizes allow.

    Per token, the rollout pool's groups generate in parallel (1 / the sum of their rates); the
    training pool's stages (log-probs, training) each own their GPUs and stream mini-batches
    through, so the slowest sets its pace (the largest 1 / rate). With rollout and training
    overlapped, an iteration takes the longer of the two pools; the plan minimises it, then
    (among equally fast plans) leaves the fewest GPUs unused, then minimises the imbalance.
    """
    rollout = [g for g in groups if g.kind in ROLLOUT_POOL_KINDS]
    training = [
        g
        for g in groups
        if g.kind not in ROLLOUT_POOL_KINDS
        and g.kind not in CPU_SIDE_KINDS
        and not (g.kind is ComponentKind.REWARD and g.gpus == 0)
    ]
    if not rollout or not training:
        raise ValueError("total_gpus: a split needs at least one rollout group and one training group")

    def rate(node: HyperNode, gpus: int) -> float:
        return predictor.predict(node.id, node.kind, gpus)

    # best_rollout[b] = (highest summed rate, sizes) using at most b GPUs; likewise the training
    # pool's lowest slowest-stage seconds per token. Small knapsacks: few groups, few hundred GPUs.
    def seconds_per_token(node: HyperNode, gpus: int) -> float:
        r = rate(node, gpus)
        return 1.0 / r if r > 0 else math.inf

    best_rollout = _knapsack(rollout, total_gpus, rate, combine=operator.add, maximise=True)
    best_training = _knapsack(training, total_gpus, seconds_per_token, combine=max, maximise=False)
    best: tuple[float, int, float] | None = None
    plan: SplitPlan | None = None
    for rollout_budget in range(total_gpus + 1):
        r = best_rollout[rollout_budget]
        t = best_training[total_gpus - rollout_budget]
        if r is None or t is None or r[0] <= 0 or not math.isfinite(t[0]):
            continue
        rollout_s, training_s = 1.0 / r[0], t[0]
        used = sum(r[1].values()) + sum(t[1].values())
        key = (max(rollout_s, training_s), used, abs(rollout_s - training_s))
        if best is None or _better_split(key, best):
            best = key
            plan = SplitPlan({**r[1], **t[1]}, rollout_s, training_s)
    if plan is None:
        raise ValueError(f"total_gpus: {total_gpus} GPUs cannot hold every group at a valid size")
    return plan


_Entry = tuple[float, dict[str, int]] | None


def _better_split(candidate: tuple[float, int, float], best: tuple[float, int, float]) -> bool:
    """Shorter iteration first; among equally short ones (floating-point ties), the one that
    uses more of the GPUs, then the better balanced one."""
    iteration_s, used, imbalance = candidate
    best_s, best_used, best_imbalance = best
    if not math.isclose(iteration_s, best_s, rel_tol=1e-9):
        return iteration_s < best_s
    if used != best_used:
        return used > best_used
    return imbalance < best_imbalance


def _knapsack(
    nodes: Sequence[HyperNode],
    budget: int,
    value: Callable[[HyperNode, int], float],
    *,
    combine: Callable[[float, float], float],
    maximise: bool,
) -> list[_Entry]:
    """For each budget b, the best ``combine``-fold of ``value(node, gpus)`` (starting from 0)
    with every node at a valid size and at most b GPUs in all (``None`` when the minimum sizes
    do not fit)."""

    def better(a: float, b: float) -> bool:
        return a > b if maximise else a < b

    table: list[_Entry] = [(0.0, {})] * (budget + 1)
    for node in nodes:
        options = _size_options(node, budget)
        nxt: list[_Entry] = [None] * (budget + 1)
        for b in range(budget + 1):
            for gpus in options:
                if gpus > b:
                    break
                prev = table[b - gpus]
                if prev is None:
                    continue
                total = combine(prev[0], value(node, gpus))
                current = nxt[b]
                if current is None or better(total, current[0]):
                    nxt[b] = (total, {**prev[1], node.id: gpus})
        table = nxt
    # "At most b": carry the best smaller budget forward.
    for b in range(1, budget + 1):
        prev, cur = table[b - 1], table[b]
        if prev is not None and (cur is None or better(prev[0], cur[0])):
            table[b] = prev
    return table


class BidirectionalPolicy(BasePolicy):
    """BiDiRL's planner and bidirectional scheduler.

    ``plan_initial_split`` sizes the rollout pool (rollout groups) and the training pool (actor,
    inference / reference, GPU reward) from the predictor's time-performance model so that
    rollout time ~ training time (see ``plan_split``). At run time the bottleneck side borrows
    the other pool's idle GPUs (``Reason.BORROW_IDLE_POOL``): the trainer takes the rollout's
    drained engines, the rollout takes the trainer's GPUs while it waits for data. Borrowed GPUs go
    back as soon as the lender has work again (``Reason.RETURN_BORROWED``) and at iteration end.
    BiDiRL's hot switch is cheap; a move whose predicted switch takes longer than
    ``max_switch_s`` is not worth borrowing for and is skipped.

    | parameter | default | meaning |
    | --- | --- | --- |
    | `idle_fraction_threshold` | 0.5 | share of a group's workers idle over the window for it to lend |
    | `cooldown_s` | 2.0 | no new borrow touching a group for this long after its last move |
    | `max_switch_s` | 10.0 | skip a borrow whose predicted switch takes longer than this |
    """

    name = "bidirectional"
    placement = Placement.DISAGGREGATED
    PARAMS = (
        ParamSpec(
            "idle_fraction_threshold",
            0.5,
            "share of a group's workers idle over the window for it to lend",
            minimum=0.0,
            maximum=1.0,
        ),
        ParamSpec(
            "cooldown_s", 2.0, "no new borrow touching a group for this long after its last move", minimum=0.0
        ),
        ParamSpec(
            "max_switch_s",
            10.0,
            "skip a borrow whose predicted switch takes longer than this",
            minimum=0.0,
            exclusive_minimum=True,
        ),
    )

    def plan_initial_split(self, total_gpus: int, groups: Sequence[HyperNode]) -> dict[str, int] | None:
        if total_gpus <= 0:
            raise ValueError(f"total_gpus must be positive, got {total_gpus}")
        plan = plan_split(self.predictor, total_gpus, groups)
        return {g.id: plan.gpus.get(g.id, g.gpus) for g in groups}

    def decide(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> list[Decision]:
        self._sync(graph, now, free_devices)
        busy = self.pending.busy_groups()
        decisions: list[Decision] = []

        for lender_id in sorted({loan.lender for loan in self.loans.loans}):
            sig = signals.get(lender_id)
            if sig is None or lender_id in busy or not self._has_work(sig):
                continue
            for move in self.loans.return_moves(graph, lender=lender_id):
                if move.borrower.id in busy:
                    continue
                devices = move.devices
                decisions.append(
                    make_decision(
                        self.name,
                        Reason.RETURN_BORROWED,
                        f"{lender_id} has work again: {move.borrower.id} returns {len(devices)} GPUs",
                        donor=move.borrower,
                        recipient=move.lender,
                        device_ids=[d.id for d in devices],
                        at=now,
                    )
                )
                self.loans.settle(lender_id, move.borrower.id, [d.id for d in devices])
                graph = apply_move(graph, move.borrower.id, lender_id, devices)
                busy.update((move.borrower.id, lender_id))

        actor = next(iter(graph.by_kind(ComponentKind.ACTOR)), None)
        rollouts = list(graph.by_kind(ComponentKind.ROLLOUT))
        if actor is None or not rollouts:
            return self._issued(decisions, now)
        for rollout in rollouts:
            for borrower, lender in ((actor, rollout), (rollout, actor)):
                decision = self._borrow(
                    graph, graph.node(borrower.id), graph.node(lender.id), signals, busy, now
                )
                if decision is not None:
                    decisions.append(decision)
                    graph = apply_move(graph, decision.donor, decision.recipient, _devices(graph, decision))
                    busy.update((borrower.id, lender.id))
        return self._issued(decisions, now)

    def on_iteration_end(
        self, graph: Hypergraph, now: float, signals: Mapping[str, GroupSignals] | None = None
    ) -> list[Decision]:
        self._sync(graph, now)
        return self._issued(self._return_loans(graph, now), now)

    # -- pieces ------------------------------------------------------------------------------

    def _idle(self, sig: GroupSignals) -> bool:
        return not sig.busy or sig.low_utilisation_fraction >= self.param_float("idle_fraction_threshold")

    def _has_work(self, sig: GroupSignals) -> bool:
        return sig.busy and (sig.queue_length > 0 or not self._idle(sig))

    def _borrow(
        self,
        graph: Hypergraph,
        borrower: HyperNode,
        lender: HyperNode,
        signals: Mapping[str, GroupSignals],
        busy: set[str],
        now: float,
    ) -> Decision | None:
        borrower_sig, lender_sig = signals.get(borrower.id), signals.get(lender.id)
        if borrower_sig is None or lender_sig is None:
            return None
        if borrower.id in busy or lender.id in busy:
            return None
        if not (movable_at_runtime(borrower) and movable_at_runtime(lender)):
            return None
        if not (self.cooldowns.ready(borrower.id, now) and self.cooldowns.ready(lender.id, now)):
            return None
        # No chains: a group that lent GPUs does not borrow, and one that borrowed does not lend.
        if self.loans.outstanding(lender=borrower.id) or self.loans.outstanding(borrower=lender.id):
            return None
        if not self._has_work(borrower_sig) or self._idle(borrower_sig) or not self._idle(lender_sig):
            return None
        if lender_sig.busy:
            # Only the lender's drained workers go; its busy ones keep serving.
            by_id: dict[str, Worker] = {w.id: w for w in lender.workers}
            offered = [by_id[w] for w in lender_sig.low_utilisation_workers if w in by_id]
        else:
            offered = list(lender.workers)
        workers = largest_valid_transfer(lender, borrower, offered)
        if not workers:
            return None
        devices = devices_of(workers)
        cost_s = migration_cost_s(self.cost_model, lender, borrower, len(devices))
        if cost_s > self.param_float("max_switch_s"):
            return None
        self.loans.lend(lender.id, borrower.id, [d.id for d in devices], now)
        return make_decision(
            self.name,
            Reason.BORROW_IDLE_POOL,
            f"{borrower.id} is the bottleneck (queue {borrower_sig.queue_length}); borrows {len(devices)} idle "
            f"GPUs of {lender.id} (switch ~{cost_s:.1f}s)",
            donor=lender,
            recipient=borrower,
            device_ids=[d.id for d in devices],
            at=now,
        )


def _devices(graph: Hypergraph, decision: Decision) -> list[Device]:
    known = {d.id: d for n in graph.nodes for w in n.workers for d in w.devices}
    return [known[d] for d in decision.device_ids if d in known]
