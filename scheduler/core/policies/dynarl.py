"""DynaRL's scheduling policy (Algorithm 1): shrink drained dynamic groups, grow the bottleneck."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from scheduler.core.decisions import Candidate, Decision, Prediction, Reason
from scheduler.core.hypergraph import ComponentKind, Device, Hypergraph, HyperNode, Worker
from scheduler.core.policies.base import BasePolicy, Placement
from scheduler.core.policies.moves import (
    apply_move,
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
from scheduler.core.policies.params import ParamSpec
from scheduler.core.predictor import ThroughputPredictor
from scheduler.core.signals import GroupSignals

NOT_BEST = "a better candidate was chosen"
_T = TypeVar("_T")


@dataclass(frozen=True)
class _Tail:
    """A dynamic group whose workers have mostly drained: its stragglers, not its GPUs, set its pace."""

    needed_workers: int  # workers still needed to hold its remaining requests


class _JobModel:
    """Predicted job tokens/s as allocations change, built once per tick.

    Stages are component kinds: groups of one kind share that stage's work, so a stage runs at
    the sum of its groups' rates, and the job at its slowest stage. Only pacing (non-drained)
    groups count when any stage has one; drained groups cost a penalty when left with fewer
    workers than their remaining requests need. A candidate changes two groups, so everything
    else is worked out once.
    """

    def __init__(self, predictor: ThroughputPredictor, graph: Hypergraph, tails: Mapping[str, _Tail]) -> None:
        self.predictor = predictor
        self.tails = tails
        self.nodes: dict[str, HyperNode] = {n.id: n for n in graph.nodes}
        self.gpus: dict[str, int] = {}
        self.rates: dict[str, float] = {}
        pacing: dict[ComponentKind, float] = {}
        every: dict[ComponentKind, float] = {}
        self.slow_tails: dict[str, float] = {}  # drained group -> its penalty factor, when under 1
        for node in graph.nodes:
            gpus = node.gpus
            self.gpus[node.id] = gpus
            if gpus <= 0:
                continue  # CPU-side groups hold no GPUs
            rate = predictor.predict(node.id, node.kind, gpus)
            self.rates[node.id] = rate
            every[node.kind] = every.get(node.kind, 0.0) + rate
            if node.id in tails:
                factor = self._tail_factor(node, gpus)
                if factor < 1.0:
                    self.slow_tails[node.id] = factor
            else:
                pacing[node.kind] = pacing.get(node.kind, 0.0) + rate
        self.uses_pacing = bool(pacing)
        self.stage_rates = pacing or every

    def _tail_factor(self, node: HyperNode, gpus: int) -> float:
        needed = self.tails[node.id].needed_workers
        if needed <= 0:
            return 1.0
        return min(1.0, (gpus // node.parallelism.gpus_per_worker) / needed)

    def rate(self, changes: Mapping[str, int] | None = None) -> float:
        """Job tokens/s with ``changes`` (group id -> GPUs) applied."""
        changes = changes or {}
        stages = dict(self.stage_rates)
        penalty = 1.0
        for group_id, factor in self.slow_tails.items():
            if group_id not in changes:
                penalty *= factor
        for group_id, gpus in changes.items():
            node = self.nodes.get(group_id)
            if node is None:
                continue
            drained = group_id in self.tails
            if drained:
                penalty *= self._tail_factor(node, gpus)
                if self.uses_pacing:
                    continue  # a drained group's GPUs do not pace its stage
            new_rate = self.predictor.predict(group_id, node.kind, gpus)
            stages[node.kind] = stages.get(node.kind, 0.0) - self.rates.get(group_id, 0.0) + new_rate
        if not stages:
            return 0.0
        return max(0.0, min(stages.values())) * penalty


class DynaRLPolicy(BasePolicy):
    """Algorithm 1 of DynaRL.

    When more than ``low_fraction_threshold`` of a dynamic group's workers (rollout, inference)
    stay under ``u_low`` for ``sustain_s``, the policy weighs shrink candidates: give k of the idle
    workers (k over the sizes the donor and recipient can both run) to a bottleneck group. For each
    it predicts the donor's loss, the recipient's gain and the job's throughput with the
    predictor, prices the move (``MigrationCostModel``: the job's throughput lost while it
    switches), and takes the best predicted net gain if it clears ``min_gain_ratio``. Free devices
    go to the bottleneck the same way. Borrowed GPUs go back to their group at iteration end, or
    as soon as that group has work again and is the bottleneck. Every candidate, chosen or not,
    is kept on the decision (and in ``last_candidates``) with its prediction and why it lost.

    Beyond Algorithm 1 (``lend_idle_static``): a static group that waits for input (its workers
    under ``u_low`` for the sustained window, nothing queued; e.g. a trainer before its first
    mini-batch) lends its idle GPUs the same way, after the dynamic donors, and takes them back
    as soon as it has work. GPUs a static group lent are not passed on by the borrower: a
    trainer's valid data-parallel sizes rarely survive collecting them back from several groups.

    Job model (pipelined, disaggregated): the job runs at its slowest stage (DynaRL's
    approximation); a stage is a component kind, its groups' rates add up. A drained group is
    paced by its stragglers, not its GPUs, so it does not bind while it keeps enough workers for
    its remaining requests (``in_flight + queue_length`` over ``max_in_flight_per_worker``, or
    its busy workers when the engine concurrency is unknown); keeping fewer slows the job in
    proportion. A drained group stays drained until requests queue for it again or its progress
    restarts; a group that has not started yet is not drained. A group waiting for input (not
    busy, or mostly idle) is not a recipient: more GPUs would idle there too. Recipients are
    ranked slowest stage first. Gains last until the recipient's work in this iteration is done,
    estimated from its progress and the time since the iteration began (``default_horizon_s``
    until known).

    | parameter | default | meaning |
    | --- | --- | --- |
    | `u_low` | 0.2 | utilisation under which a worker counts as idle (configure the signal window with it) |
    | `low_fraction_threshold` | 0.5 | fraction of a dynamic group's workers that must be idle to trigger |
    | `sustain_s` | 10.0 | seconds the trigger must hold; the signal window counts towards it |
    | `cooldown_s` | 10.0 | no new move touching a group for this long after its last one |
    | `min_gain_ratio` | 0.05 | hysteresis: predicted job gain / job throughput a move must reach |
    | `max_candidates` | 16 | shrink candidates weighed per trigger (sizes spread over the range) |
    | `max_recipients` | 3 | bottleneck groups weighed as recipients per trigger, slowest first |
    | `lend_idle_static` | True | static groups waiting for input lend their idle GPUs too |
    | `default_horizon_s` | 30.0 | expected useful time of a move while the recipient's remaining time is unknown |
    | `max_horizon_s` | 600.0 | cap on that estimate, so an early, noisy progress reading cannot justify any cost |
    """

    name = "dynarl"
    placement = Placement.DISAGGREGATED
    PARAMS = (
        ParamSpec("u_low", 0.2, "utilisation under which a worker counts as idle", minimum=0.0, maximum=1.0),
        ParamSpec(
            "low_fraction_threshold",
            0.5,
            "fraction of a dynamic group's workers that must be idle to trigger",
            minimum=0.0,
            maximum=1.0,
        ),
        ParamSpec("sustain_s", 10.0, "seconds the trigger must hold (the signal window counts)", minimum=0.0),
        ParamSpec(
            "cooldown_s", 10.0, "no new move touching a group for this long after its last", minimum=0.0
        ),
        ParamSpec(
            "min_gain_ratio", 0.05, "predicted job gain / job throughput a move must reach", minimum=0.0
        ),
        ParamSpec("max_candidates", 16, "shrink candidates weighed per trigger", minimum=1),
        ParamSpec("max_recipients", 3, "bottleneck groups weighed as recipients per trigger", minimum=1),
        ParamSpec("lend_idle_static", True, "static groups waiting for input lend their idle GPUs too"),
        ParamSpec(
            "default_horizon_s",
            30.0,
            "useful time of a move while the recipient's remaining time is unknown",
            minimum=0.0,
            exclusive_minimum=True,
        ),
        ParamSpec(
            "max_horizon_s",
            600.0,
            "cap on the estimated useful time of a move",
            minimum=0.0,
            exclusive_minimum=True,
        ),
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._low_since: dict[str, float] = {}
        # Dynamic groups that drained this iteration and have not had new work since; they stay
        # paced by their stragglers even while the few workers they kept look busy.
        self._drained: set[str] = set()
        self._last_progress: dict[str, float] = {}
        self.last_candidates: tuple[Candidate, ...] = ()

    @property
    def u_low(self) -> float:
        return self.param_float("u_low")

    # -- the tick ----------------------------------------------------------------------------

    def decide(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> list[Decision]:
        self._sync(graph, now, free_devices)
        self._track_triggers(graph, signals, now)
        busy = self.pending.busy_groups()
        decisions: list[Decision] = []
        considered: list[Candidate] = []

        for returned in self._returns_to_working_groups(graph, signals, busy, now):
            decisions.append(returned)
            graph = self._after(graph, returned)
            busy.update(g for g in (returned.donor, returned.recipient) if g)

        tails = self._tails(graph, signals)
        model = self._job_model(graph, tails)
        # Recipients are ranked once per graph: the bottleneck order does not depend on the donor.
        ranked = self._bottlenecks(graph, model, signals, busy, now)
        for donor in self._triggered_donors(graph, signals, busy, now):
            if donor.id in busy:
                continue
            others = [n for n in ranked if n.id != donor.id and n.id not in busy]
            shrink, candidates = self._shrink(graph, model, others, donor, signals, now)
            considered.extend(candidates)
            if shrink is not None and shrink.recipient is not None:
                decisions.append(shrink)
                graph = self._after(graph, shrink)
                busy.update((donor.id, shrink.recipient))
                self.loans.pass_on(donor.id, shrink.recipient, shrink.device_ids, now)
                model = self._job_model(graph, tails)
                ranked = self._bottlenecks(graph, model, signals, busy, now)

        if free_devices:
            growth, candidates = self._grow_into_free(graph, model, signals, free_devices, busy, now)
            considered.extend(candidates)
            if growth is not None:
                decisions.append(growth)

        self.last_candidates = tuple(considered)
        return self._issued(decisions, now)

    def on_iteration_end(self, graph: Hypergraph, now: float) -> list[Decision]:
        """Every borrowed GPU goes home: the next iteration's rollout needs its full size."""
        self._sync(graph, now)
        self._low_since.clear()
        self._drained.clear()
        decisions = []
        for move in self.loans.return_moves(graph):
            if not movable_between_iterations(move.borrower) or not movable_between_iterations(move.lender):
                continue
            devices = move.devices
            decisions.append(
                make_decision(
                    self.name,
                    Reason.RETURN_BORROWED,
                    f"iteration {graph.iteration} ended: {move.borrower.id} returns {len(devices)} "
                    f"borrowed GPUs to {move.lender.id}",
                    donor=move.borrower,
                    recipient=move.lender,
                    device_ids=[d.id for d in devices],
                    at=now,
                )
            )
            self.loans.settle(move.lender.id, move.borrower.id, [d.id for d in devices])
        return self._issued(decisions, now)

    # -- triggers ----------------------------------------------------------------------------

    def _track_triggers(self, graph: Hypergraph, signals: Mapping[str, GroupSignals], now: float) -> None:
        threshold = self.param_float("low_fraction_threshold")
        for node in graph.nodes:
            sig = signals.get(node.id)
            if sig is not None and sig.low_utilisation_fraction > threshold and self._may_lend(node, sig):
                self._low_since.setdefault(node.id, now)
                if node.is_dynamic:
                    self._drained.add(node.id)
            else:
                self._low_since.pop(node.id, None)
            if sig is None:
                continue
            if node.id in self._drained and self._has_new_work(node.id, sig):
                self._drained.discard(node.id)
            self._last_progress[node.id] = sig.progress

    def _may_lend(self, node: HyperNode, sig: GroupSignals) -> bool:
        """Dynamic groups lend when drained; static ones (with ``lend_idle_static``) only while
        they wait for input with nothing queued."""
        if node.is_dynamic:
            return True
        return self.param_bool("lend_idle_static") and node.gpus > 0 and sig.queue_length == 0

    def _has_new_work(self, group_id: str, sig: GroupSignals) -> bool:
        """Requests wait for a worker, or the group's progress restarted (a new batch)."""
        restarted = sig.progress + 1e-9 < self._last_progress.get(group_id, 0.0)
        return sig.queue_length > 0 or restarted

    def _sustained_s(self, group_id: str, sig: GroupSignals, now: float) -> float:
        """How long the low-utilisation condition has held: the window it was measured over
        (the workers were idle for all of it) plus the ticks it has held since."""
        since = self._low_since.get(group_id)
        if since is None:
            return 0.0
        return sig.window_s + (now - since)

    def _sustained(self, node: HyperNode, sig: GroupSignals, now: float) -> bool:
        return self._sustained_s(node.id, sig, now) + 1e-9 >= self.param_float("sustain_s")

    def _triggered_donors(
        self, graph: Hypergraph, signals: Mapping[str, GroupSignals], busy: set[str], now: float
    ) -> list[HyperNode]:
        donors = []
        for node in graph.nodes:
            sig = signals.get(node.id)
            if sig is None or node.id not in self._low_since or node.id in busy:
                continue
            if not movable_at_runtime(node) or not self.cooldowns.ready(node.id, now):
                continue
            if not self._sustained(node, sig, now):
                continue
            donors.append(node)
        # Algorithm 1's dynamic donors first, then idle static groups; the most drained first.
        donors.sort(key=lambda n: (not n.is_dynamic, -signals[n.id].low_utilisation_fraction, n.id))
        return donors

    # -- the job model -----------------------------------------------------------------------

    def _tails(self, graph: Hypergraph, signals: Mapping[str, GroupSignals]) -> dict[str, _Tail]:
        """Drained dynamic groups: paced by their stragglers, not their GPUs. A group that has
        not started this iteration (no progress, nothing to do yet) is not drained: its
        capacity will pace the pipeline once its input arrives."""
        threshold = self.param_float("low_fraction_threshold")
        tails: dict[str, _Tail] = {}
        for node in graph.nodes:
            sig = signals.get(node.id)
            if not node.is_dynamic or sig is None:
                continue
            idle = sig.low_utilisation_fraction > threshold or not sig.busy
            if (idle and sig.progress > 0.0) or node.id in self._drained:
                tails[node.id] = _Tail(needed_workers=_needed_workers(node, sig))
        return tails

    def _job_model(self, graph: Hypergraph, tails: Mapping[str, _Tail]) -> _JobModel:
        return _JobModel(self.predictor, graph, tails)

    def _horizon_s(self, recipient: HyperNode, signals: Mapping[str, GroupSignals], now: float) -> float:
        """How long the recipient will keep using what it gets: its remaining time this iteration."""
        sig = signals.get(recipient.id)
        elapsed = self.clock.elapsed_s(now)
        if sig is None or not 0.0 < sig.progress < 1.0 or elapsed <= 0:
            return self.param_float("default_horizon_s")
        remaining = elapsed * (1.0 - sig.progress) / sig.progress
        return min(remaining, self.param_float("max_horizon_s"))

    def _bottlenecks(
        self,
        graph: Hypergraph,
        model: _JobModel,
        signals: Mapping[str, GroupSignals],
        busy: set[str],
        now: float,
    ) -> list[HyperNode]:
        """Groups that could take GPUs, the slowest predicted stage first."""
        threshold = self.param_float("low_fraction_threshold")
        eligible = []
        for node in graph.nodes:
            if node.id in busy or node.id in model.tails:
                continue
            if not movable_at_runtime(node) or not self.cooldowns.ready(node.id, now):
                continue
            sig = signals.get(node.id)
            # A group waiting for input would not use more GPUs; a dynamic group is a recipient
            # only while work queues up for it.
            if sig is None or not sig.busy or sig.low_utilisation_fraction > threshold:
                continue
            if node.is_dynamic and sig.queue_length <= 0:
                continue
            eligible.append(node)
        # The slowest stage's groups first, the slowest group first within a stage.
        eligible.sort(
            key=lambda n: (model.stage_rates.get(n.kind, math.inf), model.rates.get(n.id, 0.0), n.id)
        )
        return eligible

    # -- moves ---------------------------------------------------------------------------------

    def _shrink(
        self,
        graph: Hypergraph,
        model: _JobModel,
        ranked: Sequence[HyperNode],
        donor: HyperNode,
        signals: Mapping[str, GroupSignals],
        now: float,
    ) -> tuple[Decision | None, list[Candidate]]:
        sig = signals[donor.id]
        by_id: dict[str, Worker] = {w.id: w for w in donor.workers}
        # GPUs a static group lent stay where they are until it takes them back: a trainer's
        # valid data-parallel sizes rarely survive collecting them back from several groups.
        static_groups = [n.id for n in graph.nodes if not n.is_dynamic]
        pinned = self.loans.lent_by(static_groups)
        # A group with nothing at all to do offers every worker, not only those the window saw idle.
        offered = list(by_id) if not sig.busy else [w for w in sig.low_utilisation_workers if w in by_id]
        idle = [by_id[w] for w in offered if not any(d.id in pinned for d in by_id[w].devices)]
        recipients = list(ranked[: self.param_int("max_recipients")])
        if not idle or not recipients:
            return None, []

        if not donor.is_dynamic:
            # An idle static lender paces nothing until its input arrives; it takes its GPUs
            # back then.
            model = self._job_model(graph, {**model.tails, donor.id: _Tail(needed_workers=0)})
        candidates: list[Candidate] = []
        per_recipient = max(1, self.param_int("max_candidates") // len(recipients))
        for recipient in recipients:
            # Candidate k gives the first k bundles of idle workers: whole recipient workers,
            # k over the sizes both groups can run.
            valid, problem = _valid_prefixes(donor, recipient, bundles(recipient, idle))
            if not valid:
                candidates.append(
                    self._rejected(donor, recipient, idle, problem or "no whole workers to move")
                )
                continue
            for prefix in _spread(valid, per_recipient):
                candidates.append(self._evaluate(model, donor, recipient, prefix, signals, now))
        return self._choose(
            candidates,
            Reason.DONOR_LOW_UTILISATION,
            lambda c: (
                f"{sig.low_utilisation_fraction:.0%} of {donor.id}'s workers under u_low={self.u_low} "
                f"for {self._sustained_s(donor.id, sig, now):.0f}s: {len(c.device_ids)} GPUs to {c.recipient}"
            ),
            graph,
            now,
        )

    def _evaluate(
        self,
        model: _JobModel,
        donor: HyperNode,
        recipient: HyperNode,
        workers: Sequence[Worker],
        signals: Mapping[str, GroupSignals],
        now: float,
    ) -> Candidate:
        # ``workers`` is a valid prefix (see ``_valid_prefixes``): whole workers, valid sizes.
        devices = devices_of(workers)
        gpus = len(devices)
        sig = signals[donor.id]
        donor_gpus, recipient_gpus = model.gpus.get(donor.id, 0), model.gpus.get(recipient.id, 0)
        after = {donor.id: donor_gpus - gpus, recipient.id: recipient_gpus + gpus}
        capacity_before = self.predictor.predict(donor.id, donor.kind, donor_gpus)
        # The donor delivers what its remaining requests ask for, up to what its GPUs allow.
        demand = sig.tokens_per_s if sig.tokens_per_s > 0 else capacity_before
        donor_before = min(capacity_before, demand)
        needed = _needed_workers(donor, sig)
        kept = len(donor.workers) - len(workers)
        donor_after = min(self.predictor.predict(donor.id, donor.kind, after[donor.id]), donor_before)
        if needed > 0:
            donor_after *= min(1.0, kept / needed)
        prediction = Prediction(
            donor_before=donor_before,
            donor_after=donor_after,
            recipient_before=self.predictor.predict(recipient.id, recipient.kind, recipient_gpus),
            recipient_after=self.predictor.predict(recipient.id, recipient.kind, after[recipient.id]),
            job_before=model.rate(),
            job_after=model.rate(after),
        )
        taken_back = math.ceil(sig.in_flight * len(workers) / max(len(donor.workers), 1))
        cost_s = migration_cost_s(
            self.cost_model,
            donor,
            recipient,
            gpus,
            requests_taken_back=taken_back,
            donor_gpus=donor_gpus,
            recipient_gpus=recipient_gpus,
        )
        return self._scored(
            donor, recipient, devices, prediction, cost_s, self._horizon_s(recipient, signals, now)
        )

    def _grow_into_free(
        self,
        graph: Hypergraph,
        model: _JobModel,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        busy: set[str],
        now: float,
    ) -> tuple[Decision | None, list[Candidate]]:
        candidates: list[Candidate] = []
        for recipient in self._bottlenecks(graph, model, signals, busy, now)[:1]:
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
                prediction = Prediction(
                    donor_before=0.0,
                    donor_after=0.0,
                    recipient_before=self.predictor.predict(recipient.id, recipient.kind, recipient.gpus),
                    recipient_after=self.predictor.predict(
                        recipient.id, recipient.kind, recipient.gpus + gpus
                    ),
                    job_before=model.rate(),
                    job_after=model.rate({recipient.id: recipient.gpus + gpus}),
                )
                cost_s = migration_cost_s(self.cost_model, None, recipient, gpus)
                horizon_s = self._horizon_s(recipient, signals, now)
                candidates.append(self._scored(None, recipient, devices, prediction, cost_s, horizon_s))
        return self._choose(
            candidates,
            Reason.GROW_INTO_FREE_DEVICES,
            lambda c: f"{len(c.device_ids)} free GPUs to the bottleneck {c.recipient}",
            graph,
            now,
        )

    def _returns_to_working_groups(
        self, graph: Hypergraph, signals: Mapping[str, GroupSignals], busy: set[str], now: float
    ) -> list[Decision]:
        """Borrowed GPUs go back as soon as their group has work again and is the bottleneck: a
        dynamic group once it is no longer drained and requests queue up for it (the pipeline
        waits on it), a static one as soon as it has anything to do."""
        tails = self._tails(graph, signals)
        decisions = []
        lenders = sorted({loan.lender for loan in self.loans.loans})
        for lender_id in lenders:
            sig = signals.get(lender_id)
            if sig is None or lender_id in busy:
                continue
            try:
                lender = graph.node(lender_id)
            except KeyError:
                continue
            if lender.is_dynamic:
                # A drained group's few remaining workers look busy: only queued requests count.
                if lender_id in tails or not sig.busy or sig.queue_length <= 0:
                    continue
            elif not (sig.queue_length > 0 or (sig.busy and sig.in_flight > 0)):
                continue  # an idle static lender takes its GPUs back as soon as it has work
            for move in self.loans.return_moves(graph, lender=lender_id):
                if move.borrower.id in busy:
                    continue
                devices = move.devices
                decisions.append(
                    make_decision(
                        self.name,
                        Reason.RETURN_BORROWED,
                        f"{lender_id} has work again (queue {sig.queue_length}) and is the bottleneck: "
                        f"{move.borrower.id} returns {len(devices)} GPUs",
                        donor=move.borrower,
                        recipient=lender,
                        device_ids=[d.id for d in devices],
                        at=now,
                    )
                )
                self.loans.settle(lender_id, move.borrower.id, [d.id for d in devices])
                graph = apply_move(graph, move.borrower.id, lender_id, devices)
                busy.update((move.borrower.id, lender_id))
        return decisions

    # -- scoring ------------------------------------------------------------------------------

    def _rejected(
        self, donor: HyperNode, recipient: HyperNode | None, workers: Sequence[Worker], why: str
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

    def _scored(
        self,
        donor: HyperNode | None,
        recipient: HyperNode,
        devices: Sequence[Device],
        prediction: Prediction,
        cost_s: float,
        horizon_s: float,
    ) -> Candidate:
        """Score = tokens gained over the horizon after the switch, minus tokens lost while the
        job switches (the whole job waits for the move, conservatively)."""
        gain = prediction.gain
        score = gain * max(0.0, horizon_s - cost_s) - prediction.job_before * cost_s
        why = None
        ratio = gain / prediction.job_before if prediction.job_before > 0 else math.inf if gain > 0 else 0.0
        if ratio < self.param_float("min_gain_ratio"):
            why = f"predicted job gain {ratio:.1%} is under min_gain_ratio {self.param_float('min_gain_ratio'):.1%}"
        elif score <= 0:
            why = f"migration cost {cost_s:.2f}s outweighs the predicted gain over {horizon_s:.0f}s"
        return Candidate(
            donor=donor.id if donor else None,
            recipient=recipient.id,
            device_ids=tuple(d.id for d in devices),
            prediction=prediction,
            migration_cost_s=cost_s,
            score=score,
            rejected_because=why,
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

    @staticmethod
    def _after(graph: Hypergraph, decision: Decision) -> Hypergraph:
        all_devices = {d.id: d for n in graph.nodes for w in n.workers for d in w.devices}
        devices = [all_devices[d] for d in decision.device_ids if d in all_devices]
        return apply_move(graph, decision.donor, decision.recipient, devices)

    def state_to_json(self) -> dict[str, Any]:
        return {
            **super().state_to_json(),
            "low_since": dict(self._low_since),
            "drained": sorted(self._drained),
            "last_progress": dict(self._last_progress),
        }

    def load_state(self, data: Mapping[str, Any]) -> None:
        super().load_state(data)
        self._low_since = {k: float(v) for k, v in data.get("low_since", {}).items()}
        self._drained = set(data.get("drained", []))
        self._last_progress = {k: float(v) for k, v in data.get("last_progress", {}).items()}


def _needed_workers(node: HyperNode, sig: GroupSignals) -> int:
    """Workers a serving group needs for the requests it still has."""
    outstanding = sig.in_flight + sig.queue_length
    if sig.max_in_flight_per_worker > 0:
        return math.ceil(outstanding / sig.max_in_flight_per_worker)
    if outstanding <= 0 and not sig.busy:
        return 0
    idle = len(set(sig.low_utilisation_workers) & {w.id for w in node.workers})
    return max(1, len(node.workers) - idle) if (outstanding > 0 or sig.busy) else 0


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
