"""Feeding a policy's decisions to a control plane that runs one migration per job at a time.

The simulator applies every decision a policy returns at once. The live control plane carries
out one migration per job at a time, and asks the policy only between migrations, so the hook
that returns loans at an iteration boundary (one decision per lender and borrower) and a
``decide`` that returns several moves would lose all but the first. ``SerialDriver`` keeps the
rest in a queue that the caller persists between ticks, hands them out one per call, and calls
``on_iteration_end`` when the job's iteration has moved on since the policy last looked — even
if a migration was in flight at the boundary.

A queued decision that no longer fits the job when its turn comes is dropped, and the policy
told (``decision_refused``), as the caller tells it of a decision its planner refuses.

A placement change the policy re-planned at the boundary (colocated or disaggregated) is handed
to the caller (``placement_change``) before any move: the caller places the job anew, or refuses
and tells the policy why. A caller that cannot place a job anew says so at construction
(``placement_changes=False``), and the driver refuses every change for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.core.decisions import Decision
from scheduler.core.hypergraph import Device, Hypergraph
from scheduler.core.policies.base import PLACEMENT_CHANGE_UNSUPPORTED, PlacementChange, SchedulingPolicy
from scheduler.core.signals import GroupSignals


@dataclass(frozen=True)
class DroppedDecision:
    """A queued decision that no longer fits the job when its turn came."""

    decision: Decision
    why: str


class SerialDriver:
    """One decision per call: queued ones first (oldest first), then the policy's new ones."""

    def __init__(
        self, policy: SchedulingPolicy, queued: Sequence[Decision] = (), *, placement_changes: bool = False
    ) -> None:
        self.policy = policy
        policy.placement_changes_supported = placement_changes
        self.queued: list[Decision] = list(queued)
        self.dropped: list[DroppedDecision] = []  # by the last ``next_decision``
        self.iteration_ended = False  # whether the last ``next_decision`` called the hook
        # The placement the policy re-planned at this boundary, for the caller to carry out (or
        # refuse with ``policy.placement_refused``) before any move.
        self.placement_change: PlacementChange | None = None

    def next_decision(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> Decision | None:
        """The move to start now, or None. Call only while no migration of the job is open."""
        self.dropped = []
        self.placement_change = None
        self.iteration_ended = self.policy.iteration_advanced(graph)
        if self.iteration_ended:
            # The boundary's moves go first: they set up the next iteration's split.
            self.queued[:0] = self.policy.on_iteration_end(graph, now, signals)
            change = self.policy.next_placement()
            if change is not None and not self.policy.placement_changes_supported:
                self.policy.placement_refused(change, PLACEMENT_CHANGE_UNSUPPORTED)
            elif change is not None:
                self.placement_change = change
                return None
        free = {d.id for d in free_devices}
        while self.queued:
            decision = self.queued.pop(0)
            why = _no_longer_fits(decision, graph, free)
            if why is None:
                return decision
            self.dropped.append(DroppedDecision(decision, why))
            self.policy.decision_refused(decision, why)
        proposed = self.policy.decide(graph, signals, free_devices, now)
        if not proposed:
            return None
        self.queued.extend(proposed[1:])
        return proposed[0]

    def queued_to_json(self) -> list[dict[str, Any]]:
        return [d.to_json() for d in self.queued]

    @staticmethod
    def queued_from_json(data: Sequence[Mapping[str, Any]]) -> list[Decision]:
        return [Decision.from_json(item) for item in data]


def _no_longer_fits(decision: Decision, graph: Hypergraph, free: set[str]) -> str | None:
    """Why a queued decision cannot go ahead on this graph, or None when it can."""
    groups = {node.id: node for node in graph.nodes}
    if decision.recipient is not None and decision.recipient not in groups:
        return f"recipient {decision.recipient} is no longer part of the job"
    if decision.donor is None:
        missing = [d for d in decision.device_ids if d not in free]
        holder = "the free pool"
    elif decision.donor not in groups:
        return f"donor {decision.donor} is no longer part of the job"
    else:
        held = set(groups[decision.donor].device_ids)
        missing = [d for d in decision.device_ids if d not in held]
        holder = decision.donor
    if missing:
        return f"{len(missing)} of its {len(decision.device_ids)} GPUs are no longer with {holder}"
    return None
