import json
import random
from dataclasses import replace

import pytest

from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Candidate, Decision, Prediction, Reason
from scheduler.core.hypergraph import (
    ComponentKind,
    Device,
    Hypergraph,
    HyperNode,
    MigrationStrategy,
    Parallelism,
    Worker,
)
from scheduler.core.migration import (
    MigrationPlan,
    PlanError,
    PlanExecution,
    PlannedStep,
    StepKind,
    StepState,
    plan_migration,
)

K = StepKind
COSTS = MigrationCostModel(model_params_b=7.0)


def _workers(prefix: str, node: str, count: int, gpus_each: int = 1) -> tuple[Worker, ...]:
    return tuple(
        Worker(
            id=f"{prefix}{k}",
            devices=tuple(
                Device(id=f"{node}-g{k * gpus_each + g}", node=node, hardware="H100")
                for g in range(gpus_each)
            ),
        )
        for k in range(count)
    )


def _graph() -> Hypergraph:
    return Hypergraph(
        job_id="job-1",
        nodes=(
            HyperNode(id="rollout", kind=ComponentKind.ROLLOUT, workers=_workers("r", "n0", 4)),
            HyperNode(
                id="actor",
                kind=ComponentKind.ACTOR,
                workers=_workers("a", "n1", 2, gpus_each=2),
                parallelism=Parallelism(tp=2),
            ),
            HyperNode(id="reward", kind=ComponentKind.REWARD, workers=_workers("rw", "n2", 2)),
            HyperNode(id="tool", kind=ComponentKind.TOOL, workers=_workers("t", "n3", 1)),
        ),
    )


def _decision(
    donor: str | None,
    recipient: str | None,
    devices: tuple[str, ...],
    donor_strategy: MigrationStrategy | None = None,
    recipient_strategy: MigrationStrategy | None = None,
) -> Decision:
    return Decision(
        policy="test",
        reason=Reason.DONOR_LOW_UTILISATION,
        detail="test move",
        donor=donor,
        recipient=recipient,
        device_ids=devices,
        donor_strategy=donor_strategy,
        recipient_strategy=recipient_strategy,
        at=100.0,
    )


ROLLOUT_TO_ACTOR = _decision(
    "rollout", "actor", ("n0-g2", "n0-g3"), MigrationStrategy.WORKLOAD, MigrationStrategy.P2P
)


def _plan(decision: Decision = ROLLOUT_TO_ACTOR, migration_id: str = "m1", **kw: int) -> MigrationPlan:
    return plan_migration(decision, _graph(), COSTS, migration_id=migration_id, **kw)


def _kinds(plan: MigrationPlan) -> list[StepKind]:
    return [s.kind for s in plan.steps]


# --- step order per strategy -----------------------------------------------------------------


def test_workload_donor_then_p2p_recipient_order() -> None:
    plan = _plan()
    assert _kinds(plan) == [
        K.PAUSE_WORKERS,
        K.TAKE_BACK_REQUESTS,
        K.REDISTRIBUTE_REQUESTS,
        K.RELEASE_DEVICES,
        K.RESERVE_DEVICES,
        K.START_WORKERS,
        K.TRANSFER_STATE,
        K.REBUILD_GROUPS,
        K.BARRIER,
        K.SWITCH,
        K.DESTROY_OLD,
    ]
    assert [s.group_id for s in plan.steps] == ["rollout"] * 4 + ["actor"] * 7
    assert plan.groups == ("rollout", "actor")
    pause, take_back, redistribute, release = plan.steps[:4]
    assert take_back.worker_ids == ("r2", "r3")
    assert pause.worker_ids == ("r2", "r3")
    assert redistribute.worker_ids == ("r0", "r1")  # the remaining workers receive the requests
    assert release.device_ids == ("n0-g2", "n0-g3")
    start = plan.steps[5]
    assert start.worker_ids == ("actor-m1-w0",)  # tp=2: two devices make one new worker
    assert start.devices_by_worker() == {"actor-m1-w0": ("n0-g2", "n0-g3")}
    switch = plan.steps[9]
    assert switch.worker_ids == ("a0", "a1", "actor-m1-w0")  # membership after the switch
    assert switch.point_of_no_return
    assert plan.steps[10].worker_ids == ()  # growing: nothing to kill, only old process groups


def test_restart_order() -> None:
    plan = _plan(
        _decision("reward", "tool", ("n2-g1",), MigrationStrategy.RESTART, MigrationStrategy.RESTART)
    )
    assert _kinds(plan) == [
        K.DRAIN,
        K.STOP_WORKERS,
        K.RELEASE_DEVICES,
        K.START_WORKERS,
        K.HEALTH_CHECK,
        K.SWITCH,
    ]
    assert plan.steps[0].worker_ids == ("rw1",)
    assert plan.steps[5].worker_ids == ("t0", "tool-m1-w0")


def test_p2p_donor_order_and_workload_recipient() -> None:
    plan = _plan(_decision("actor", "rollout", ("n1-g2", "n1-g3")))  # strategies default by kind
    assert _kinds(plan) == [
        K.TRANSFER_STATE,
        K.REBUILD_GROUPS,
        K.BARRIER,
        K.SWITCH,
        K.DESTROY_OLD,
        K.RELEASE_DEVICES,
        K.START_WORKERS,
        K.HEALTH_CHECK,
        K.SWITCH,
        K.SHED_REQUESTS,
        K.REDISTRIBUTE_REQUESTS,
    ]
    assert plan.steps[0].strategy is MigrationStrategy.P2P
    assert plan.steps[6].strategy is MigrationStrategy.WORKLOAD
    assert plan.steps[3].worker_ids == ("a0",)  # the trainer shrinks to the staying rank
    assert plan.steps[4].worker_ids == ("a1",)  # the leaving rank is destroyed after the switch
    assert plan.steps[6].worker_ids == ("rollout-m1-w0", "rollout-m1-w1")
    # One point of no return per side, and the donor's release after its switch is not one.
    assert [s.index for s in plan.steps if s.point_of_no_return] == [3, 8]
    # After the switch the 4 engines the rollout had hand a third of their queues to the 2 new
    # ones; neither step has a compensation (the side only rolls forward by then).
    shed, redistribute = plan.steps[9], plan.steps[10]
    assert shed.worker_ids == ("r0", "r1", "r2", "r3") and shed.share == pytest.approx(2 / 6)
    assert redistribute.worker_ids == ("rollout-m1-w0", "rollout-m1-w1")
    assert redistribute.device_ids == ("n1-g2", "n1-g3")
    assert shed.compensation() is None and redistribute.compensation() is None
    assert PlannedStep.from_json(shed.to_json()) == shed


def test_a_rollout_with_no_engine_left_grows_without_shedding() -> None:
    graph = _graph()
    empty = replace(graph.node("rollout"), workers=(), min_workers=0)
    graph = replace(graph, nodes=(empty, *graph.nodes[1:]))
    plan = plan_migration(_decision("actor", "rollout", ("n1-g2", "n1-g3")), graph, COSTS, migration_id="m1")
    assert K.SHED_REQUESTS not in _kinds(plan)


def test_one_sided_plans() -> None:
    grow = plan_migration(_decision(None, "actor", ("free-0", "free-1")), _graph(), COSTS, migration_id="g")
    assert _kinds(grow)[0] is K.RESERVE_DEVICES
    assert {s.group_id for s in grow.steps} == {"actor"}
    release = plan_migration(_decision("rollout", None, ("n0-g0",)), _graph(), COSTS, migration_id="r")
    assert _kinds(release) == [
        K.PAUSE_WORKERS,
        K.TAKE_BACK_REQUESTS,
        K.REDISTRIBUTE_REQUESTS,
        K.RELEASE_DEVICES,
    ]
    assert release.steps[-1].point_of_no_return


def test_donor_releases_before_recipient_starts_and_old_workers_untouched_until_switch() -> None:
    for decision in (
        ROLLOUT_TO_ACTOR,
        _decision("actor", "rollout", ("n1-g2", "n1-g3")),
        _decision("reward", "tool", ("n2-g1",)),
    ):
        plan = _plan(decision)
        release = next(s.index for s in plan.steps if s.kind is K.RELEASE_DEVICES)
        start = next(s.index for s in plan.steps if s.kind is K.START_WORKERS)
        assert release < start
        recipient = decision.recipient
        old = {w.id for w in _graph().node(recipient or "").workers}
        switch = next(s.index for s in plan.steps if s.kind is K.SWITCH and s.group_id == recipient)
        destructive = {K.DRAIN, K.STOP_WORKERS, K.PAUSE_WORKERS, K.DESTROY_OLD, K.RELEASE_DEVICES}
        for step in plan.steps[:switch]:
            if step.group_id == recipient and step.kind in destructive:
                assert not old & set(step.worker_ids), step


# --- ids, estimates, JSON ------------------------------------------------------------------


def test_step_ids_are_deterministic() -> None:
    first, second = _plan(), _plan()
    assert first == second
    assert [s.step_id for s in first.steps][:2] == ["m1:00:pause_workers", "m1:01:take_back_requests"]
    assert all(s.step_id == f"m1:{s.index:02d}:{s.kind.value}" for s in first.steps)
    assert len({s.step_id for s in first.steps}) == len(first.steps)
    assert _plan(migration_id="m2").steps[0].step_id == "m2:00:pause_workers"


def test_estimates_split_the_cost_model() -> None:
    plan = _plan(requests_taken_back=500)
    donor_s = sum(s.estimated_s for s in plan.steps if s.group_id == "rollout")
    recipient_s = sum(s.estimated_s for s in plan.steps if s.group_id == "actor")
    assert donor_s == pytest.approx(
        COSTS.estimate_s(
            MigrationStrategy.WORKLOAD, gpus_moved=2, recipient_gpus_after=2, requests_taken_back=500
        )
    )
    assert recipient_s == pytest.approx(
        COSTS.estimate_s(MigrationStrategy.P2P, gpus_moved=2, recipient_gpus_after=6)
    )
    assert plan.estimated_s == pytest.approx(donor_s + recipient_s)
    # The transfer carries the bytes/bandwidth part: each of 6 ranks receives 1/6 of the state.
    transfer = next(s for s in plan.steps if s.kind is K.TRANSFER_STATE)
    assert transfer.estimated_s == pytest.approx(COSTS.trainer_state_gb / 6 / COSTS.p2p_bandwidth_gb_s)
    redistribute = next(s for s in plan.steps if s.kind is K.REDISTRIBUTE_REQUESTS)
    assert redistribute.estimated_s == pytest.approx(0.5)
    # More requests to hand over make the plan longer.
    assert plan.estimated_s > _plan(requests_taken_back=0).estimated_s


def test_plan_json_round_trip() -> None:
    decision = Decision(
        policy="dynarl",
        reason=Reason.DONOR_LOW_UTILISATION,
        detail="rollout idle",
        donor="rollout",
        recipient="actor",
        device_ids=("n0-g2", "n0-g3"),
        donor_strategy=MigrationStrategy.WORKLOAD,
        recipient_strategy=None,
        chosen=Candidate(
            donor="rollout",
            recipient="actor",
            device_ids=("n0-g2", "n0-g3"),
            prediction=Prediction(100.0, 90.0, 50.0, 70.0, 50.0, 70.0),
            migration_cost_s=1.5,
            score=20.0,
        ),
        candidates=(
            Candidate(
                donor="rollout",
                recipient="actor",
                device_ids=("n0-g3",),
                prediction=None,
                migration_cost_s=1.0,
                score=-1.0,
                rejected_because="invalid dp",
            ),
        ),
        at=12.5,
    )
    plan = _plan(decision)
    assert MigrationPlan.from_json(plan.to_json()) == plan
    assert MigrationPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert Decision.from_json(decision.to_json()) == decision
    step = plan.steps[0]
    assert PlannedStep.from_json(json.loads(json.dumps(step.to_json()))) == step


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("decision", "message"),
    [
        (_decision("rollout", "actor", ()), "no devices"),
        (_decision("rollout", "actor", ("n0-g2", "n0-g2")), "twice"),
        (_decision(None, None, ("x",)), "neither"),
        (_decision("rollout", "rollout", ("n0-g2",)), "same group"),
        (_decision("ghost", "actor", ("n0-g2",)), "not a group"),
        (_decision("rollout", "actor", ("n1-g0", "n0-g2")), "does not hold"),
        (_decision("actor", "rollout", ("n1-g2",)), "part of a worker"),
        (_decision("rollout", "actor", ("n0-g3",)), "devices per worker"),
        (_decision(None, "actor", ("n0-g0", "n0-g1")), "not free"),
        (_decision("rollout", "tool", tuple(f"n0-g{k}" for k in range(4))), "cannot run with 0"),
    ],
)
def test_invalid_decisions_are_refused(decision: Decision, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        _plan(decision)


def test_time_shared_devices_do_not_move() -> None:
    # Colocated: the reward's workers time-share the rollout's first two devices.
    graph = _graph()
    shared = tuple(Worker(id=f"rw{k}", devices=graph.node("rollout").workers[k].devices) for k in range(2))
    graph = graph.with_node(HyperNode(id="reward", kind=ComponentKind.REWARD, workers=shared))
    for decision in (
        _decision("rollout", "actor", ("n0-g0", "n0-g1")),
        _decision("reward", "actor", ("n0-g1",)),
    ):
        with pytest.raises(PlanError, match=r"time-shared .*n0-g1 by reward, rollout"):
            plan_migration(decision, graph, COSTS, migration_id="m")
    # Nor does a move whose steps would act on a time-sharing worker: the agents refuse those steps,
    # so on a gang spread over nodes one node would switch and another not. The rollout giving up
    # the devices it holds alone would hand its requests to r0 and r1, which time-share theirs.
    with pytest.raises(
        PlanError, match=r"redistribute_requests step would act on workers on time-shared devices .*r0, r1"
    ):
        plan_migration(_decision("rollout", "actor", ("n0-g2", "n0-g3")), graph, COSTS, migration_id="m")
    # Growing the rollout would switch every member, the time-sharing ones included.
    with pytest.raises(PlanError, match=r"rollout's \w+ step would act on workers on time-shared devices"):
        plan_migration(_decision("actor", "rollout", ("n1-g0", "n1-g1")), graph, COSTS, migration_id="m")
    # A group without a time-sharing worker still moves.
    plan = plan_migration(_decision("actor", "tool", ("n1-g0", "n1-g1")), graph, COSTS, migration_id="m")
    assert plan.steps


def test_migration_id_may_not_break_step_ids() -> None:
    with pytest.raises(PlanError):
        _plan(migration_id="a:b")


def test_recipient_hardware_affinity_is_checked() -> None:
    graph = _graph()
    picky = graph.node("tool")
    graph = graph.with_node(
        HyperNode(id="tool", kind=ComponentKind.TOOL, workers=picky.workers, hardware_affinity=("A100",))
    )
    with pytest.raises(PlanError, match="hardware"):
        plan_migration(_decision("reward", "tool", ("n2-g1",)), graph, COSTS, migration_id="m")


# --- rollback ------------------------------------------------------------------------------


def test_rollback_steps_reverse_and_only_for_what_ran() -> None:
    plan = _plan()
    # The recipient's transfer (index 6) failed: undo it, the start and the reservation, newest
    # first. The donor side committed at its release (index 3) and is not compensated.
    rollback = plan.rollback_steps(6)
    assert [s.kind for s in rollback] == [K.DISCARD_TRANSFER, K.DESTROY_NEW, K.RELEASE_RESERVATION]
    assert [s.index for s in rollback] == [6, 5, 4]
    assert rollback[1].worker_ids == ("actor-m1-w0",)
    assert all(s.rollback_kind is None and not s.point_of_no_return for s in rollback)
    assert rollback[0].step_id == "m1:06:discard_transfer"
    # A failure on the donor side before its release: resume the donors with their requests.
    assert [s.kind for s in plan.rollback_steps(2)] == [K.RETURN_REQUESTS, K.RESUME_WORKERS]
    assert [s.kind for s in plan.rollback_steps(0)] == [K.RESUME_WORKERS]
    # After the recipient's switch there is nothing to compensate.
    assert plan.rollback_steps(10) == ()
    with pytest.raises(IndexError):
        plan.rollback_steps(11)


def _drive(execution: PlanExecution, fail: dict[str, int]) -> list[PlannedStep]:
    """Run the plan, failing step ids the given number of times; returns the issued steps."""
    issued: list[PlannedStep] = []
    while (step := execution.next_step()) is not None:
        issued.append(step)
        if fail.get(step.step_id, 0) > 0:
            fail[step.step_id] -= 1
            execution.report(step.step_id, ok=False, error="boom")
        else:
            execution.report(step.step_id, ok=True)
        assert len(issued) < 100
    return issued


def test_happy_path_commits() -> None:
    plan = _plan()
    execution = PlanExecution(plan)
    assert execution.state == "planned"
    issued = _drive(execution, {})
    assert issued == list(plan.steps)
    assert execution.state == "committed"
    assert execution.committed_groups == ("rollout", "actor")
    assert set(execution.states().values()) == {StepState.DONE}


P2P_RECIPIENT_BEFORE_SWITCH = [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("failed_index", P2P_RECIPIENT_BEFORE_SWITCH)
def test_p2p_failure_before_switch_rolls_back(failed_index: int) -> None:
    plan = _plan()
    execution = PlanExecution(plan)
    failed = plan.steps[failed_index]
    issued = _drive(execution, {failed.step_id: 1})
    assert execution.state == "rolled_back"
    compensations = issued[failed_index + 1 :]
    assert compensations == list(plan.rollback_steps(failed_index))
    assert [c.index for c in compensations] == sorted((c.index for c in compensations), reverse=True)
    # The reservation is always released, new workers always destroyed once started.
    assert compensations[-1].kind is K.RELEASE_RESERVATION
    assert (K.DESTROY_NEW in [c.kind for c in compensations]) == (failed_index >= 5)
    # Nothing after the failure ran, and the old workers were never touched.
    assert all(s.index <= failed_index for s in issued)
    assert not any(s.kind is K.DESTROY_OLD for s in issued)
    # The donor had committed: its devices stay released, the trainer keeps its old layout.
    assert execution.committed_groups == ("rollout",)
    states = execution.states()
    assert states[failed.step_id] in (StepState.ROLLED_BACK, StepState.FAILED)
    assert states[plan.steps[10].step_id] is StepState.SKIPPED
    assert states[plan.steps[4].step_id] is StepState.ROLLED_BACK
    assert states[plan.steps[3].step_id] is StepState.DONE
    assert execution.error(failed.step_id) == "boom"


@pytest.mark.parametrize("failed_index", [0, 1, 2, 3])
def test_donor_failure_before_release_resumes_donors(failed_index: int) -> None:
    plan = _plan()
    execution = PlanExecution(plan)
    issued = _drive(execution, {plan.steps[failed_index].step_id: 1})
    assert execution.state == "rolled_back"
    assert execution.committed_groups == ()
    assert issued[-1].kind is K.RESUME_WORKERS
    assert not any(s.group_id == "actor" for s in issued)


def test_p2p_donor_failure_after_switch_rolls_forward() -> None:
    plan = _plan(_decision("actor", "rollout", ("n1-g2", "n1-g3")))
    destroy_old = plan.steps[4]
    assert destroy_old.kind is K.DESTROY_OLD
    execution = PlanExecution(plan, max_attempts=3)
    issued = _drive(execution, {destroy_old.step_id: 2})
    assert execution.state == "committed"
    assert [s.step_id for s in issued].count(destroy_old.step_id) == 3
    assert not execution.compensations


def test_failure_after_switch_gives_up_without_rolling_back() -> None:
    plan = _plan()
    destroy_old = plan.steps[10]
    execution = PlanExecution(plan, max_attempts=2)
    issued = _drive(execution, {destroy_old.step_id: 5})
    assert execution.state == "failed"
    assert [s.step_id for s in issued].count(destroy_old.step_id) == 2
    assert execution.committed_groups == ("rollout", "actor")
    assert not execution.compensations
    assert execution.next_step() is None


def test_switch_failure_itself_rolls_back() -> None:
    plan = _plan()
    switch = plan.steps[9]
    execution = PlanExecution(plan)
    _drive(execution, {switch.step_id: 1})
    assert execution.state == "rolled_back"
    assert execution.committed_groups == ("rollout",)


def test_compensation_failure_is_retried_then_gives_up() -> None:
    plan = _plan()
    execution = PlanExecution(plan, max_attempts=2)
    destroy_new = plan.steps[5].compensation()
    assert destroy_new is not None
    _drive(execution, {plan.steps[6].step_id: 1, destroy_new.step_id: 1})
    assert execution.state == "rolled_back"
    execution = PlanExecution(plan, max_attempts=2)
    _drive(execution, {plan.steps[6].step_id: 1, destroy_new.step_id: 2})
    assert execution.state == "failed"


def test_repeated_report_is_a_no_op() -> None:
    plan = _plan()
    execution = PlanExecution(plan)
    first = execution.next_step()
    assert first is not None and first.index == 0
    assert execution.next_step() == first  # asking again issues the same step
    execution.report(first.step_id, ok=True)
    execution.report(first.step_id, ok=True)
    execution.report(first.step_id, ok=False, error="late")  # first outcome wins
    second = execution.next_step()
    assert second is not None and second.index == 1
    assert execution.step_state(first.step_id) is StepState.DONE
    execution.report(second.step_id, ok=False)
    snapshot = execution.to_json()
    execution.report(second.step_id, ok=False)  # a repeated failure does not fail twice
    assert execution.to_json() == snapshot
    assert execution.state == "rolling_back"


def test_reports_out_of_order_or_unknown_are_refused() -> None:
    plan = _plan()
    execution = PlanExecution(plan)
    execution.next_step()
    with pytest.raises(ValueError):
        execution.report(plan.steps[3].step_id, ok=True)
    with pytest.raises(KeyError):
        execution.report("m1:99:switch", ok=True)


def test_execution_resumes_from_json() -> None:
    plan = _plan()
    execution = PlanExecution(plan)
    _drive_until = plan.steps[6]
    while (step := execution.next_step()) is not None and step != _drive_until:
        execution.report(step.step_id, ok=True)
    execution.report(_drive_until.step_id, ok=False, error="nccl timeout")
    saved = json.loads(json.dumps(execution.to_json()))
    resumed = PlanExecution.from_json(MigrationPlan.from_json(plan.to_json()), saved)
    assert resumed.state == "rolling_back"
    assert resumed.states() == execution.states()
    assert resumed.next_step() == execution.next_step()
    with pytest.raises(ValueError):
        PlanExecution.from_json(_plan(migration_id="other"), saved)


@pytest.mark.parametrize("seed", range(40))
def test_never_half_switched_under_random_failures(seed: int) -> None:
    rng = random.Random(seed)
    decision = rng.choice(
        [
            ROLLOUT_TO_ACTOR,
            _decision("actor", "rollout", ("n1-g2", "n1-g3")),
            _decision("reward", "tool", ("n2-g1",)),
        ]
    )
    plan = _plan(decision)
    execution = PlanExecution(plan, max_attempts=3)
    issued: list[PlannedStep] = []
    while (step := execution.next_step()) is not None:
        issued.append(step)
        ok = rng.random() > 0.15
        execution.report(step.step_id, ok=ok)
        if rng.random() < 0.2:
            execution.report(step.step_id, ok=rng.random() < 0.5)  # duplicate delivery
        assert len(issued) < 200
    assert execution.state in ("committed", "rolled_back", "failed")
    states = execution.states()
    for group in plan.groups:
        side = [s for s in plan.steps if s.group_id == group]
        switched = any(s.point_of_no_return and states[s.step_id] is StepState.DONE for s in side)
        if switched:
            # Past its point of no return a side is never compensated.
            assert not any(c.group_id == group for c in execution.compensations)
        else:
            # Every started side that did not switch was fully undone (or the plan needs help).
            for s in side:
                if states[s.step_id] in (StepState.DONE, StepState.ROLLED_BACK) and s.rollback_kind:
                    compensation = s.compensation()
                    assert compensation is not None
                    assert states[compensation.step_id] is StepState.DONE or execution.state == "failed"
            # The recipient's old workers were never destroyed.
            assert not any(s.kind is K.DESTROY_OLD and s.group_id == group for s in issued)
