"""SerialDriver: a policy's decisions carried out one migration at a time, across rebuilt ticks."""

import json
from dataclasses import replace
from typing import Any

from scheduler.core.decisions import Decision, Reason
from scheduler.core.hypergraph import Hypergraph
from scheduler.core.policies import Placement
from scheduler.core.policies.base import PLACEMENT_CHANGE_UNSUPPORTED
from scheduler.core.policies.dynarl import DynaRLPolicy
from scheduler.core.policies.serial import SerialDriver
from tests.scheduler_core.test_policies_dynarl import finished_stages, memory, policy_with
from tests.scheduler_core.test_policies_fixtures import land, make_policy


class LiveTicks:
    """What the control plane's tick does: rebuild the policy and the driver from JSON state."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = {"policy": state, "queued": []}

    def tick(self, graph: Hypergraph, signals: Any, now: float) -> tuple[Decision | None, SerialDriver]:
        state = json.loads(json.dumps(self.state))
        policy = policy_with(state["policy"])
        driver = SerialDriver(policy, SerialDriver.queued_from_json(state["queued"]))
        decision = driver.next_decision(graph, signals, [], now)
        self.state = {"policy": policy.state_to_json(), "queued": driver.queued_to_json()}
        return decision, driver


def pooled_loans() -> tuple[LiveTicks, Hypergraph, Any]:
    """The trainer grown 8 -> 16 ranks on loans from two drained groups, 4 GPUs each."""
    graph, signals = finished_stages()
    ticks = LiveTicks(memory(batch_done=True))
    for now in (90.0, 92.0):
        decision, _ = ticks.tick(graph, signals, now)
        assert decision is not None and decision.recipient == "actor"
        graph = land(graph, [decision])
    assert len(graph.node("actor").workers) == 16
    return ticks, graph, signals


def test_every_loan_goes_home_one_migration_at_a_time_after_an_iteration_boundary():
    ticks, graph, signals = pooled_loans()
    # The iteration moved on while a migration was in flight: the first tick that may decide
    # again still calls the boundary hook, starts one return and queues the other.
    boundary = replace(graph, iteration=1)
    first, driver = ticks.tick(boundary, signals, now=130.0)
    assert driver.iteration_ended
    assert first is not None and first.reason is Reason.RETURN_BORROWED and first.donor == "actor"
    assert len(ticks.state["queued"]) == 1
    graph = land(boundary, [first])
    second, driver = ticks.tick(graph, signals, now=134.0)
    assert not driver.iteration_ended
    assert second is not None and second.reason is Reason.RETURN_BORROWED
    assert {first.recipient, second.recipient} == {"rollout", "inference"}
    assert ticks.state["queued"] == []
    graph = land(graph, [second])
    assert len(graph.node("actor").workers) == 8
    assert len(graph.node("rollout").workers) == 4 and len(graph.node("inference").workers) == 4


def test_a_queued_return_whose_gpus_moved_meanwhile_is_dropped_with_the_reason():
    ticks, graph, signals = pooled_loans()
    boundary = replace(graph, iteration=1)
    first, _ = ticks.tick(boundary, signals, now=130.0)
    assert first is not None
    [queued] = SerialDriver.queued_from_json(ticks.state["queued"])
    # The queued return's GPUs left the trainer another way (released to the free pool).
    graph = land(boundary, [first, replace(queued, recipient=None)])
    decision, driver = ticks.tick(graph, signals, now=134.0)
    [dropped] = driver.dropped
    assert dropped.decision.device_ids == queued.device_ids
    assert "no longer with actor" in dropped.why
    assert decision is None or set(decision.device_ids).isdisjoint(queued.device_ids)
    # The policy was told (``decision_refused``): the dropped return is no longer awaited.
    pending = [m.device_ids for m in policy_with(ticks.state["policy"]).pending.moves]
    assert tuple(queued.device_ids) not in pending


def test_several_decisions_from_one_decide_are_started_in_turn_not_lost():
    graph, signals = finished_stages()
    decisions = [
        Decision("p", Reason.RETURN_BORROWED, f"move {i}", "actor", "rollout", (d,), None, None)
        for i, d in enumerate(graph.node("actor").device_ids[:2])
    ]

    class TwoAtOnce:
        def __init__(self) -> None:
            self.policy = make_policy("static-disaggregated")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.policy, name)

        def decide(self, *args: Any) -> list[Decision]:
            return list(decisions)

    driver = SerialDriver(TwoAtOnce())  # type: ignore[arg-type]
    assert driver.next_decision(graph, signals, [], 1.0) == decisions[0]
    restored = SerialDriver(driver.policy, SerialDriver.queued_from_json(driver.queued_to_json()))
    assert restored.next_decision(graph, signals, [], 2.0) == decisions[1]


def test_a_static_policy_never_sees_an_iteration_end_nor_queues_anything():
    graph, signals = finished_stages()
    driver = SerialDriver(make_policy("static-disaggregated"))
    for iteration in range(3):
        assert (
            driver.next_decision(replace(graph, iteration=iteration), signals, [], float(iteration)) is None
        )
        assert not driver.iteration_ended and driver.queued == []


def test_decisions_round_trip_through_json_exactly():
    graph, signals = finished_stages()
    policy = policy_with(memory(batch_done=True))
    [decision] = policy.decide(graph, signals, [], now=90.0)
    assert decision.chosen is not None and decision.candidates
    assert Decision.from_json(json.loads(json.dumps(decision.to_json()))) == decision


def _measured_no_tail_iteration(policy: DynaRLPolicy) -> None:
    """What the ticks measured of iteration 0 (as a restored policy state holds it): a rollout
    with no tail and a pipeline doing most of the work, so colocated is predicted faster."""
    policy.clock.iteration = 0
    policy.ledger.load(
        {
            "iteration": 0,
            "started_at": 100.0,
            "last_at": 199.0,
            "ticks": 90,
            "sums": {
                "rollout_body_s": 20.0,
                "rollout_body_gpu_s": 160.0,
                "pipeline_gpu_s": 500.0,
                "tokens": 1e6,
            },
            "rollout_gpus_max": 8,
            "job_gpus_max": 12,
        }
    )


def test_a_driver_that_cannot_place_a_job_anew_keeps_the_placement_and_says_what_it_would_have_chosen():
    policy = policy_with(memory())
    driver = SerialDriver(policy)
    assert policy.placement_changes_supported is False
    _measured_no_tail_iteration(policy)
    graph, signals = finished_stages()
    driver.next_decision(replace(graph, iteration=1), signals, [], now=200.0)
    assert driver.iteration_ended and driver.placement_change is None
    assert policy.mode is Placement.DISAGGREGATED
    assert "colocated saves" in policy.replan_note
    assert f"[not carried out: {PLACEMENT_CHANGE_UNSUPPORTED}]" in policy.replan_note
    assert policy.next_placement() is None


def test_the_live_driver_hands_a_placement_change_over_before_any_move_and_a_refusal_undoes_it():
    policy = policy_with(memory())
    driver = SerialDriver(policy, placement_changes=True)
    assert policy.placement_changes_supported is True
    _measured_no_tail_iteration(policy)
    graph, signals = finished_stages()
    decision = driver.next_decision(replace(graph, iteration=1), signals, [], now=200.0)
    change = driver.placement_change
    assert decision is None and change is not None
    assert change.placement is Placement.COLOCATED and "colocated saves" in change.detail
    assert policy.mode is Placement.COLOCATED and driver.queued == []
    # The caller could not place the job anew: the policy keeps the placement it has, says why.
    policy.placement_refused(change, "actor: 12 workers is outside its limits (2–6)")
    assert policy.mode is Placement.DISAGGREGATED
    assert "[not carried out: actor: 12 workers is outside its limits (2–6)]" in policy.replan_note
    # The next call is an ordinary one: no change is handed over twice.
    driver.next_decision(replace(graph, iteration=1), signals, [], now=201.0)
    assert driver.placement_change is None


def loan_book(policy: DynaRLPolicy) -> list[tuple[str, str, frozenset[str]]]:
    return sorted((loan.lender, loan.borrower, frozenset(loan.device_ids)) for loan in policy.loans.loans)


def test_a_return_the_planner_refuses_is_owed_again_and_holds_no_group_back():
    ticks, graph, signals = pooled_loans()
    boundary = replace(graph, iteration=1)
    first, _ = ticks.tick(boundary, signals, now=130.0)
    assert first is not None and first.reason is Reason.RETURN_BORROWED
    [queued] = SerialDriver.queued_from_json(ticks.state["queued"])
    # The control plane's planner refuses it (the tick tells the policy, as here): nothing moved.
    policy = policy_with(json.loads(json.dumps(ticks.state["policy"])))
    assert first.recipient not in {loan.lender for loan in policy.loans.loans}
    policy.decision_refused(first, "donor actor cannot run with 7 workers")
    # No longer awaited (the queued return still is).
    assert [m.device_ids for m in policy.pending.moves] == [tuple(queued.device_ids)]
    owed = policy.loans.outstanding(lender=first.recipient, borrower="actor")
    assert {d for loan in owed for d in loan.device_ids} == set(first.device_ids)


def test_a_refused_move_leaves_the_loans_as_they_were_and_drops_the_rest_of_its_pool():
    graph, signals = finished_stages()
    policy = policy_with(memory(batch_done=True))
    # The trainer lent 2 of its GPUs to the log-prob group, and borrows 8 of the rollout's.
    policy.loans.lend("actor", "inference", ["n0-g20", "n0-g21"], at=70.0)
    policy.loans.lend("rollout", "actor", [f"n0-g{40 + i}" for i in range(8)], at=80.0)
    before = loan_book(policy)
    [first] = policy.decide(graph, signals, [], now=90.0)
    assert "pool" in first.detail and loan_book(policy) != before
    assert any(o.recipient == "actor" for o in policy.outcomes.open)
    policy.decision_refused(first, "devices are not free")
    assert loan_book(policy) == before
    assert policy.pending.moves == [] and not any(o.recipient == "actor" for o in policy.outcomes.open)
    # Nothing is awaited and no leg of the refused pool follows: the next tick weighs anew.
    [again] = policy.decide(graph, signals, [], now=91.0)
    assert "pooled move, next leg" not in again.detail and again.recipient == "actor"
