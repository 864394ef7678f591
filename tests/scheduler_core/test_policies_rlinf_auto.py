import pytest

from scheduler.core.decisions import Reason
from scheduler.core.hypergraph import ComponentKind, Hypergraph, HyperNode, Parallelism
from scheduler.core.policies.rlinf_auto import instances_needed, release_plan
from scheduler.core.signals import GroupSignals
from tests.scheduler_core.test_policies_fixtures import (
    devices_of,
    free_devices,
    land,
    make_graph,
    make_group,
    make_policy,
    make_signals,
)

ROLLOUT = ComponentKind.ROLLOUT
ACTOR = ComponentKind.ACTOR
INFERENCE = ComponentKind.INFERENCE
TRAINER_DP = Parallelism(tp=2, valid_dp=(1, 2, 4, 8))


def job(*extra: HyperNode) -> Hypergraph:
    return make_graph(
        make_group("actor", ACTOR, 2, first_device=50, gpus_per_worker=2, parallelism=TRAINER_DP),
        make_group("rollout", ROLLOUT, 8, first_device=0),
        *extra,
    )


def running(
    graph: Hypergraph, *, in_flight: int, actor_progress: float = 0.3, **rollout: object
) -> dict[str, GroupSignals]:
    fields = {"in_flight": in_flight, "max_in_flight_per_worker": 32, "progress": 0.6, **rollout}
    return {
        "rollout": make_signals(graph.node("rollout"), **fields),
        "actor": make_signals(graph.node("actor"), progress=actor_progress),
    }


def finished(graph: Hypergraph, group: str = "rollout") -> GroupSignals:
    return make_signals(graph.node(group), in_flight=0, queue_length=0, busy=False, progress=1.0)


@pytest.mark.parametrize("running_requests, expected", [(0, 0), (1, 1), (64, 2), (65, 3), (70, 3)])
def test_instances_needed_is_ceil_of_running_over_max_running(running_requests: int, expected: int) -> None:
    assert instances_needed(running_requests, 32) == expected


def test_instances_needed_rejects_a_zero_concurrency():
    with pytest.raises(ValueError, match="max_running_requests"):
        instances_needed(10, 0)


def test_release_plan_picks_the_largest_reachable_actor_size_with_the_fewest_instances():
    one_gpu_units = {"unit_gpus": [1] * 8, "unit_instances": [1] * 8}
    # 5 of 8 instances may go; the actor can grow by 4 or 12 GPUs -> 4 instances.
    assert release_plan(**one_gpu_units, releasable_instances=5, actor_growth_steps=[4, 12]) == 4
    # With all 8 releasable, +12 is still out of reach; the largest reachable step wins.
    assert release_plan(**one_gpu_units, releasable_instances=8, actor_growth_steps=[2, 4, 12]) == 4
    assert release_plan(**one_gpu_units, releasable_instances=1, actor_growth_steps=[2, 4]) == 0
    # Two 1-GPU engines per tp=2 trainer rank group: units of 2 instances.
    assert (
        release_plan(
            unit_gpus=[2, 2, 2], unit_instances=[2, 2, 2], releasable_instances=5, actor_growth_steps=[4, 6]
        )
        == 2
    )
    # A step the units cannot hit exactly is skipped for a smaller one.
    assert (
        release_plan(
            unit_gpus=[4, 4], unit_instances=[1, 1], releasable_instances=2, actor_growth_steps=[6, 4]
        )
        == 1
    )


def test_unneeded_rollout_instances_go_to_the_actor():
    graph = job()
    policy = make_policy("rlinf-auto", use_pre_process_policy=False)
    [decision] = policy.decide(graph, running(graph, in_flight=70), [], now=0.0)
    assert decision.reason is Reason.RELEASE_UNNEEDED_ROLLOUT
    assert (decision.donor, decision.recipient) == ("rollout", "actor")
    # ceil(70/32) = 3 needed, 5 releasable; the actor's next valid size (4 workers x tp 2) takes 4.
    assert set(decision.device_ids) == devices_of(graph.node("rollout"), range(4))
    assert "ceil(70/32)=3" in decision.detail


def test_no_release_while_every_instance_is_needed():
    graph = job()
    policy = make_policy("rlinf-auto", use_pre_process_policy=False)
    assert policy.decide(graph, running(graph, in_flight=200, queue_length=56), [], now=0.0) == []


def test_engine_concurrency_falls_back_to_the_parameter():
    graph = job()
    signals = running(graph, in_flight=70, max_in_flight_per_worker=0)
    assert make_policy("rlinf-auto", use_pre_process_policy=False).decide(graph, signals, [], now=0.0) == []
    [decision] = make_policy("rlinf-auto", use_pre_process_policy=False, max_running_requests=32).decide(
        graph, signals, [], now=0.0
    )
    assert len(decision.device_ids) == 4


def test_free_gpus_are_used_before_rollout_instances():
    graph = job()
    policy = make_policy("rlinf-auto", use_pre_process_policy=False)
    decisions = policy.decide(graph, running(graph, in_flight=70), free_devices(4), now=0.0)
    # 4 free GPUs already take the actor to its next valid size (4 workers); reaching 8 would
    # need 8 more GPUs, more than the 5 releasable instances.
    assert [d.reason for d in decisions] == [Reason.GROW_INTO_FREE_DEVICES]
    assert len(land(graph, decisions).node("actor").workers) == 4


def test_wait_before_last_iter_holds_partial_releases_in_the_last_minibatch():
    graph = job()
    policy = make_policy("rlinf-auto", use_pre_process_policy=False, n_minibatches=4)
    # Actor progress 0.8: its last of 4 mini-batches.
    assert policy.decide(graph, running(graph, in_flight=70, actor_progress=0.8), [], now=0.0) == []
    signals = {"rollout": finished(graph), "actor": make_signals(graph.node("actor"), progress=0.8)}
    [decision] = policy.decide(graph, signals, [], now=1.0)
    assert decision.reason is Reason.RELEASE_UNNEEDED_ROLLOUT
    assert "finished" in decision.detail


def test_without_the_wait_policy_nothing_moves_in_the_last_minibatch():
    graph = job()
    policy = make_policy("rlinf-auto", use_pre_process_policy=False, use_wait_before_last_iter_policy=False)
    signals = {"rollout": finished(graph), "actor": make_signals(graph.node("actor"), progress=0.8)}
    assert policy.decide(graph, signals, [], now=0.0) == []
    signals["actor"] = make_signals(graph.node("actor"), progress=0.3)
    assert policy.decide(graph, signals, [], now=1.0)


def test_finished_inference_releases_to_the_actor_once_allowed():
    inference = make_group("inference", INFERENCE, 2, first_device=60, gpus_per_worker=2, min_workers=0)
    graph = job(inference)
    signals = {
        **running(graph, in_flight=256),  # the rollout needs all its instances
        "inference": finished(graph, "inference"),
    }
    waiting = make_policy("rlinf-auto", use_pre_process_policy=False)
    assert waiting.decide(graph, signals, [], now=0.0) == []  # waits for the last mini-batch
    eager = make_policy("rlinf-auto", use_pre_process_policy=False, use_wait_before_last_iter_policy=False)
    [decision] = eager.decide(graph, signals, [], now=0.0)
    assert (decision.donor, decision.recipient) == ("inference", "actor")
    assert len(decision.device_ids) == 4  # actor 2 -> 4 workers


def test_pre_process_lends_the_actor_to_the_rollout_then_takes_it_back():
    graph = job()
    policy = make_policy("rlinf-auto", use_pre_process_policy=True)
    start = {
        "rollout": make_signals(
            graph.node("rollout"), in_flight=256, max_in_flight_per_worker=32, progress=0.0
        ),
        "actor": make_signals(graph.node("actor"), busy=False, progress=0.0),
    }
    [lend] = policy.decide(graph, start, [], now=0.0)
    assert lend.reason is Reason.BORROW_IDLE_POOL
    assert (lend.donor, lend.recipient) == ("actor", "rollout")
    assert len(lend.device_ids) == 2  # the actor keeps its minimum of one tp=2 worker
    graph = land(graph, [lend])
    early = {
        **start,
        "rollout": make_signals(
            graph.node("rollout"), in_flight=200, max_in_flight_per_worker=32, progress=0.3
        ),
    }
    assert policy.decide(graph, early, [], now=5.0) == []  # still under half the batch done
    half = {
        **start,
        "rollout": make_signals(
            graph.node("rollout"), in_flight=100, max_in_flight_per_worker=32, progress=0.55
        ),
    }
    [back] = policy.decide(graph, half, [], now=10.0)
    assert back.reason is Reason.RETURN_BORROWED
    assert (back.donor, back.recipient) == ("rollout", "actor")
    assert set(back.device_ids) == set(lend.device_ids)


def test_actor_returns_to_its_starting_size_at_iteration_end():
    graph = job()
    policy = make_policy("rlinf-auto", use_pre_process_policy=False)
    grown = land(graph, policy.decide(graph, running(graph, in_flight=70), [], now=0.0))
    assert len(grown.node("actor").workers) == 4
    restore = policy.on_iteration_end(grown, now=60.0)
    assert [d.reason for d in restore] == [Reason.RESTORE_AT_ITERATION_END]
    assert (restore[0].donor, restore[0].recipient) == ("actor", "rollout")
    restored = land(grown, restore)
    assert len(restored.node("actor").workers) == 2
    assert set(restored.node("rollout").device_ids) == set(graph.node("rollout").device_ids)
    assert policy.on_iteration_end(restored, now=61.0) == []
