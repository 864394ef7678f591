"""RLinf's dynamic scheduler (``cluster.auto_scheduler``), as its documentation and managers describe.

Per check, for the rollout group: the instances still needed are
``ceil(running / max_running_requests)`` (running = requests in flight plus queued); the rest
may go, but only as many as let the actor reach a larger valid data-parallel size: the largest
such size wins, with the fewest instances. Free GPUs are taken first (as RLinf counts released
but unused GPUs as available). A finished rollout (nothing running)
or a finished inference group gives all it can. Everything returns to the starting placement at
iteration end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler.core.decisions import Decision, Reason
from scheduler.core.hypergraph import ComponentKind, Device, Hypergraph, HyperNode, Worker
from scheduler.core.policies.base import BasePolicy, Placement
from scheduler.core.policies.moves import (
    apply_move,
    bundles,
    devices_of,
    largest_valid_transfer,
    make_decision,
    pick_free_devices,
    receive_problem,
    release_problem,
    valid_growth_steps,
)
from scheduler.core.policies.params import ParamSpec
from scheduler.core.signals import GroupSignals


def instances_needed(running: int, max_running_requests: int) -> int:
    """RLinf's ``ceil(running_tasks / max_running_requests)``."""
    if max_running_requests <= 0:
        raise ValueError("max_running_requests must be positive")
    return math.ceil(max(running, 0) / max_running_requests)


def release_plan(
    *,
    unit_gpus: Sequence[int],
    unit_instances: Sequence[int],
    releasable_instances: int,
    actor_growth_steps: Sequence[int],
) -> int:
    """RLinf's ``find_release_instance_num_needed``, over release units.

    A unit is the rollout instances that together make whole actor workers on one node (one
    instance when the actor's rank groups are no wider than an engine). The actor grows by the
    largest step of ``actor_growth_steps`` (GPU amounts to valid DP sizes) that a prefix of the
    units covers exactly within ``releasable_instances``; returns that prefix's length (0: none).
    """
    for step in sorted(actor_growth_steps, reverse=True):
        gpus = instances = 0
        for count, (unit_gpu, unit_instance) in enumerate(
            zip(unit_gpus, unit_instances, strict=True), start=1
        ):
            gpus += unit_gpu
            instances += unit_instance
            if instances > releasable_instances or gpus > step:
                break
            if gpus == step:
                return count
    return 0


class RLinfAutoPolicy(BasePolicy):
    """RLinf's ``auto_scheduler`` over a disaggregated placement.

    - Release: the rollout keeps ``ceil(running / max_running_requests)`` instances (the engine
      concurrency comes from the signals, else the ``max_running_requests`` parameter) and
      releases just enough of the rest for the actor's largest reachable valid DP size.
    - A finished rollout or inference group releases everything the actor can use.
    - ``use_pre_process_policy``: at the start of an iteration, while the actor has nothing to
      train, the rollout runs on the actor's GPUs too; once the rollout's running requests fall
      to ``pre_process_running_fraction`` of the batch (its progress passes 1 minus that), the
      GPUs go back and the actor starts training while the rollout finishes.
    - ``use_wait_before_last_iter_policy``: the actor's last mini-batch (its progress past
      ``(n_minibatches - 1) / n_minibatches``) sees no partial scale-in; it waits for the rollout
      and inference to finish, then takes all they release. Without it, nothing moves during the
      last mini-batch (RLinf's ``main_loop_finalize``).
    - ``on_iteration_end``: every group returns to its starting size (the actor shrinks back).

    | parameter | default | meaning |
    | --- | --- | --- |
    | `use_pre_process_policy` | True | lend the actor's GPUs to the rollout early in each iteration |
    | `use_wait_before_last_iter_policy` | True | no partial scale-in in the last mini-batch; wait for the rollout to finish |
    | `max_running_requests` | 0 | engine concurrency when the signals do not carry it (0: use the signals only) |
    | `n_minibatches` | 4 | actor mini-batches per iteration (which one is the last) |
    | `pre_process_running_fraction` | 0.5 | running share of the batch at which lent actor GPUs return |
    """

    name = "rlinf-auto"
    placement = Placement.DISAGGREGATED
    PARAMS = (
        ParamSpec(
            "use_pre_process_policy", True, "lend the actor's GPUs to the rollout early in each iteration"
        ),
        ParamSpec(
            "use_wait_before_last_iter_policy",
            True,
            "no partial scale-in in the last mini-batch; wait for the rollout to finish",
        ),
        ParamSpec(
            "max_running_requests", 0, "engine concurrency when the signals do not carry it", minimum=0
        ),
        ParamSpec("n_minibatches", 4, "actor mini-batches per iteration", minimum=1),
        ParamSpec(
            "pre_process_running_fraction",
            0.5,
            "running share of the batch at which lent actor GPUs return",
            minimum=0.0,
            maximum=1.0,
        ),
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._home: dict[str, str | None] | None = None  # device id -> group id at job start
        self._pre_process_done_for: int | None = None  # iteration whose pre-process phase is over

    # -- the tick ----------------------------------------------------------------------------

    def decide(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> list[Decision]:
        self._sync(graph, now, free_devices)
        self._remember_home(graph)
        actor = _first(graph, ComponentKind.ACTOR)
        if actor is None or actor.id not in signals:
            return []
        busy = self.pending.busy_groups()
        if busy:
            # RLinf resizes one step at a time and waits for each to finish.
            return []
        decisions: list[Decision] = []
        rollouts = [n for n in graph.by_kind(ComponentKind.ROLLOUT) if n.id in signals]

        if self.param_bool("use_pre_process_policy") and rollouts:
            pre = self._pre_process(graph, actor, rollouts[0], signals, now)
            if pre is not None:
                return self._issued([pre], now)
            if self.loans.outstanding(lender=actor.id):
                return []  # the rollout still runs on the actor's GPUs

        actor_sig = signals[actor.id]
        minibatches = self.param_int("n_minibatches")
        last_minibatch = actor_sig.progress >= (minibatches - 1) / minibatches
        wait_policy = self.param_bool("use_wait_before_last_iter_policy")
        free = list(free_devices)

        for rollout in rollouts:
            sig = signals[rollout.id]
            finished = _finished(sig)
            if last_minibatch and not (wait_policy and finished):
                continue
            actor = graph.node(actor.id)
            if finished:
                count = self._all_releasable(rollout)
                detail = f"{rollout.id} finished: releases its instances to {actor.id}"
            else:
                concurrency = sig.max_in_flight_per_worker or self.param_int("max_running_requests")
                if concurrency <= 0:
                    continue
                needed = instances_needed(sig.in_flight + sig.queue_length, concurrency)
                count = max(0, len(rollout.workers) - needed) if len(rollout.workers) > 1 else 0
                detail = (
                    f"{rollout.id} needs ceil({sig.in_flight + sig.queue_length}/{concurrency})={needed} "
                    f"of {len(rollout.workers)} instances"
                )
            made = self._grow_actor(graph, actor, rollout, count, free, detail, now)
            for decision in made:
                decisions.append(decision)
                graph = _after(graph, decision, free)
                if decision.donor is None:
                    taken = set(decision.device_ids)
                    free = [d for d in free if d.id not in taken]

        rollout_gone = all(len(n.workers) <= n.min_workers for n in graph.by_kind(ComponentKind.ROLLOUT))
        for inference in graph.by_kind(ComponentKind.INFERENCE):
            inference_sig = signals.get(inference.id)
            if inference_sig is None or not _finished(inference_sig):
                continue
            if wait_policy and not (last_minibatch or rollout_gone):
                continue
            actor = graph.node(actor.id)
            made = self._grow_actor(
                graph,
                actor,
                inference,
                self._all_releasable(inference),
                free,
                f"{inference.id} finished: releases its instances to {actor.id}",
                now,
            )
            for decision in made:
                decisions.append(decision)
                graph = _after(graph, decision, free)
                if decision.donor is None:
                    taken = set(decision.device_ids)
                    free = [d for d in free if d.id not in taken]
        return self._issued(decisions, now)

    def on_iteration_end(
        self, graph: Hypergraph, now: float, signals: Mapping[str, GroupSignals] | None = None
    ) -> list[Decision]:
        """Every group goes back to its starting placement; the actor to its starting size."""
        self._sync(graph, now)
        self._remember_home(graph)
        assert self._home is not None
        decisions: list[Decision] = []
        for holder in graph.nodes:
            foreign: dict[str | None, list[Worker]] = {}
            for worker in holder.workers:
                if not worker.devices:
                    continue  # a CPU worker: nothing to give back
                homes = [self._home.get(d.id, None) for d in worker.devices]
                home = max(set(homes), key=homes.count)
                if home != holder.id:
                    foreign.setdefault(home, []).append(worker)
            for home, workers in sorted(foreign.items(), key=lambda kv: -len(kv[1])):
                holder_now = graph.node(holder.id)
                workers = [w for w in workers if w in holder_now.workers]
                if home is None:
                    chosen = tuple(workers)
                    if release_problem(holder_now, len(chosen)) is not None:
                        continue
                    recipient = None
                else:
                    recipient = graph.node(home)
                    chosen = largest_valid_transfer(holder_now, recipient, workers)
                if not chosen:
                    continue
                devices = devices_of(chosen)
                decision = make_decision(
                    self.name,
                    Reason.RESTORE_AT_ITERATION_END,
                    f"iteration {graph.iteration} ended: {holder.id} returns {len(devices)} GPUs to "
                    f"{home or 'the free pool'}",
                    donor=holder_now,
                    recipient=recipient,
                    device_ids=[d.id for d in devices],
                    at=now,
                )
                decisions.append(decision)
                graph = apply_move(graph, holder.id, home, devices)
        self.loans.loans.clear()
        return self._issued(decisions, now)

    # -- pieces ------------------------------------------------------------------------------

    def _remember_home(self, graph: Hypergraph) -> None:
        if self._home is None:
            self._home = {d: n.id for n in graph.nodes for d in n.device_ids}

    def _pre_process(
        self,
        graph: Hypergraph,
        actor: HyperNode,
        rollout: HyperNode,
        signals: Mapping[str, GroupSignals],
        now: float,
    ) -> Decision | None:
        rollout_sig = signals[rollout.id]
        lent = self.loans.outstanding(lender=actor.id, borrower=rollout.id)
        if lent:
            # Running requests down to the threshold share of the batch = progress past 1 - share.
            if rollout_sig.progress < 1.0 - self.param_float("pre_process_running_fraction"):
                return None
            moves = self.loans.return_moves(graph, lender=actor.id, borrower=rollout.id)
            if not moves:
                return None
            move = moves[0]
            self.loans.settle(actor.id, rollout.id, [d.id for d in move.devices])
            self._pre_process_done_for = graph.iteration
            return make_decision(
                self.name,
                Reason.RETURN_BORROWED,
                f"pre-process: {rollout.id} progress {rollout_sig.progress:.0%}, the actor takes its GPUs back",
                donor=move.borrower,
                recipient=move.lender,
                device_ids=[d.id for d in move.devices],
                at=now,
            )
        if self._pre_process_done_for == graph.iteration:
            return None
        actor_sig = signals[actor.id]
        actor_idle = not actor_sig.busy and actor_sig.progress <= 0.0
        rollout_starting = rollout_sig.busy and rollout_sig.progress < 1.0 - self.param_float(
            "pre_process_running_fraction"
        )
        if not (actor_idle and rollout_starting):
            self._pre_process_done_for = graph.iteration
            return None
        workers = largest_valid_transfer(actor, rollout, list(actor.workers))
        self._pre_process_done_for = graph.iteration
        if not workers:
            return None
        devices = devices_of(workers)
        self.loans.lend(actor.id, rollout.id, [d.id for d in devices], now)
        self._pre_process_done_for = None  # the phase ends when the GPUs come back
        return make_decision(
            self.name,
            Reason.BORROW_IDLE_POOL,
            f"pre-process: {rollout.id} runs on {len(devices)} of {actor.id}'s GPUs until its running "
            f"requests fall to {self.param_float('pre_process_running_fraction'):.0%} of the batch",
            donor=actor,
            recipient=rollout,
            device_ids=[d.id for d in devices],
            at=now,
        )

    @staticmethod
    def _all_releasable(group: HyperNode) -> int:
        for count in range(len(group.workers), 0, -1):
            if release_problem(group, count) is None:
                return count
        return 0

    def _grow_actor(
        self,
        graph: Hypergraph,
        actor: HyperNode,
        donor: HyperNode,
        releasable: int,
        free: Sequence[Device],
        detail: str,
        now: float,
    ) -> list[Decision]:
        """Grow the actor to its largest reachable valid size: free GPUs first, then up to
        ``releasable`` donor instances. Each decision lands on a valid size by itself, since
        the moves are carried out one after the other."""
        decisions: list[Decision] = []
        acceptable_free = [d for d in free if actor.accepts_hardware(d.hardware)]
        free_steps = valid_growth_steps(actor, len(acceptable_free))
        if free_steps:
            devices = pick_free_devices(actor, acceptable_free, free_steps[-1])
            if devices is not None and receive_problem(actor, devices) is None:
                decisions.append(
                    make_decision(
                        self.name,
                        Reason.GROW_INTO_FREE_DEVICES,
                        f"{actor.id} grows into {len(devices)} free GPUs",
                        donor=None,
                        recipient=actor,
                        device_ids=[d.id for d in devices],
                        at=now,
                    )
                )
                graph = apply_move(graph, None, actor.id, devices)
                actor = graph.node(actor.id)
        # Emptiest workers first: they hold the fewest requests to hand over.
        order = sorted(donor.workers, key=lambda w: (w.utilisation, w.id))
        releasable = min(releasable, len(order))
        while releasable > 0 and release_problem(donor, releasable) is not None:
            releasable -= 1
        if releasable <= 0:
            return decisions
        units = bundles(actor, order)
        count = release_plan(
            unit_gpus=[len(devices_of(u)) for u in units],
            unit_instances=[len(u) for u in units],
            releasable_instances=releasable,
            actor_growth_steps=valid_growth_steps(actor, len(devices_of(order))),
        )
        if count <= 0:
            return decisions
        workers = [w for unit in units[:count] for w in unit]
        devices = devices_of(workers)
        if release_problem(donor, len(workers)) is None and receive_problem(actor, devices) is None:
            decisions.append(
                make_decision(
                    self.name,
                    Reason.RELEASE_UNNEEDED_ROLLOUT,
                    f"{detail}; releases {len(workers)} so {actor.id} grows to "
                    f"{len(actor.workers) + len(devices) // actor.parallelism.gpus_per_worker} workers",
                    donor=donor,
                    recipient=actor,
                    device_ids=[d.id for d in devices],
                    at=now,
                )
            )
        return decisions


def _first(graph: Hypergraph, kind: ComponentKind) -> HyperNode | None:
    nodes = graph.by_kind(kind)
    return nodes[0] if nodes else None


def _finished(sig: GroupSignals) -> bool:
    return sig.in_flight + sig.queue_length == 0 and (not sig.busy or sig.progress >= 1.0)


def _after(graph: Hypergraph, decision: Decision, free: Sequence[Device]) -> Hypergraph:
    known = {d.id: d for n in graph.nodes for w in n.workers for d in w.devices}
    known.update({d.id: d for d in free})
    devices = [known[d] for d in decision.device_ids if d in known]
    return apply_move(graph, decision.donor, decision.recipient, devices)
