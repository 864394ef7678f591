import json

import pytest

from scheduler.core.decisions import Reason
from scheduler.core.hypergraph import ComponentKind, Hypergraph, MigrationStrategy, Parallelism, Worker
from scheduler.core.policies.dynarl import NOT_BEST
from scheduler.core.signals import GroupSignals
from tests.scheduler_core.test_policies_fixtures import (
    devices_of,
    free_devices,
    land,
    linear_profiles,
    make_graph,
    make_group,
    make_policy,
    make_signals,
)

ROLLOUT = ComponentKind.ROLLOUT
ACTOR = ComponentKind.ACTOR


def job(rollout_workers: int = 8, actor_workers: int = 4, **actor_fields: object) -> Hypergraph:
    rollout_fields = {k[len("rollout_") :]: v for k, v in actor_fields.items() if k.startswith("rollout_")}
    actor_only = {k: v for k, v in actor_fields.items() if not k.startswith("rollout_")}
    return make_graph(
        make_group("rollout", ROLLOUT, rollout_workers, first_device=0, **rollout_fields),
        make_group("actor", ACTOR, actor_workers, first_device=50, depends_on=("rollout",), **actor_only),
    )


def drained(graph: Hypergraph, idle: int = 6, **fields: object) -> dict[str, GroupSignals]:
    """The rollout in its tail (``idle`` workers under U_low all window), the actor training."""
    rollout, actor = graph.node("rollout"), graph.node("actor")
    rollout_fields = {"in_flight": 2, "max_in_flight_per_worker": 4, "tokens_per_s": 500.0, **fields}
    return {
        "rollout": make_signals(rollout, idle=idle, **rollout_fields),
        "actor": make_signals(actor, queue_length=3, progress=0.2),
    }


def test_drained_rollout_gives_its_idle_workers_to_the_bottleneck_actor():
    graph = job()
    policy = make_policy("dynarl")
    [decision] = policy.decide(graph, drained(graph), [], now=0.0)
    assert decision.reason is Reason.DONOR_LOW_UTILISATION
    assert (decision.donor, decision.recipient) == ("rollout", "actor")
    assert set(decision.device_ids) == devices_of(graph.node("rollout"), range(6))
    assert decision.donor_strategy is MigrationStrategy.WORKLOAD
    assert decision.recipient_strategy is MigrationStrategy.P2P
    chosen = decision.chosen
    assert chosen is not None and chosen.prediction is not None
    assert chosen.prediction.job_after > chosen.prediction.job_before
    assert chosen.migration_cost_s > 0
    assert decision.to_json()["chosen"]["device_ids"] == list(decision.device_ids)


def test_every_candidate_is_recorded_and_the_best_predicted_one_wins():
    graph = job()
    # 16 requests at 4 per engine need 4 engines: taking 5 or 6 of the 6 idle ones would slow
    # the rollout's tail, so the predicted best is 4.
    [decision] = make_policy("dynarl").decide(graph, drained(graph, in_flight=16), [], now=0.0)
    assert len(decision.device_ids) == 4
    viable = [c for c in decision.candidates if c.prediction is not None]
    assert {len(c.device_ids) for c in viable} == {1, 2, 3, 4, 5, 6}
    assert decision.chosen is not None
    assert decision.chosen.score == max(c.score for c in viable)
    losers = [c for c in viable if c != decision.chosen]
    assert losers and all(c.rejected_because == NOT_BEST for c in losers)
    over_shrunk = next(c for c in viable if len(c.device_ids) == 6)
    assert over_shrunk.prediction is not None
    assert over_shrunk.prediction.donor_after < over_shrunk.prediction.donor_before


def test_no_trigger_at_or_under_the_threshold_fraction():
    graph = job()
    assert make_policy("dynarl").decide(graph, drained(graph, idle=4), [], now=0.0) == []  # 0.5 is not > 0.5
    assert make_policy("dynarl", low_fraction_threshold=0.4).decide(
        graph, drained(graph, idle=4), [], now=0.0
    )


def test_no_trigger_until_the_condition_is_sustained():
    graph = job()
    policy = make_policy("dynarl", sustain_s=10.0)
    signals = {k: GroupSignals(**{**v.to_json(), "window_s": 2.0}) for k, v in drained(graph).items()}
    assert policy.decide(graph, signals, [], now=100.0) == []
    assert policy.decide(graph, signals, [], now=107.0) == []  # 2 s window + 7 s held
    assert policy.decide(graph, signals, [], now=108.0)


def test_a_break_in_the_condition_restarts_the_sustain_clock():
    graph = job()
    policy = make_policy("dynarl", sustain_s=10.0)
    short = {k: GroupSignals(**{**v.to_json(), "window_s": 2.0}) for k, v in drained(graph).items()}
    busy = {k: GroupSignals(**{**v.to_json(), "window_s": 2.0}) for k, v in drained(graph, idle=0).items()}
    assert policy.decide(graph, short, [], now=0.0) == []
    assert policy.decide(graph, busy, [], now=5.0) == []
    assert policy.decide(graph, short, [], now=9.0) == []  # held only since 9 s
    assert policy.decide(graph, short, [], now=17.0)


def test_cooldown_blocks_a_second_move_of_the_same_group():
    graph = job()
    policy = make_policy("dynarl", cooldown_s=10.0)
    first = policy.decide(graph, drained(graph), [], now=0.0)
    assert len(first) == 1
    graph = land(graph, first)
    assert len(graph.node("rollout").workers) == 2
    again = {
        "rollout": make_signals(graph.node("rollout"), idle=2, in_flight=0, max_in_flight_per_worker=4),
        "actor": make_signals(graph.node("actor"), queue_length=3, progress=0.2),
    }
    assert policy.decide(graph, again, [], now=5.0) == []
    [second] = policy.decide(graph, again, [], now=11.0)
    assert len(second.device_ids) == 1


def test_a_move_in_flight_is_not_issued_twice():
    graph = job()
    policy = make_policy("dynarl", cooldown_s=0.0)
    assert policy.decide(graph, drained(graph), [], now=0.0)
    assert policy.decide(graph, drained(graph), [], now=1.0) == []  # not landed yet


def test_recipient_valid_dp_sizes_are_respected():
    graph = job(parallelism=Parallelism(valid_dp=(4, 8)))
    [decision] = make_policy("dynarl").decide(graph, drained(graph), [], now=0.0)
    assert len(decision.device_ids) == 4  # 4 -> 8 workers; 5, 6 or 7 are not valid
    # Candidates range over valid sizes only.
    assert {len(c.device_ids) for c in decision.candidates} == {4}


def test_a_recipient_with_no_valid_size_is_recorded_with_the_reason():
    graph = job(parallelism=Parallelism(valid_dp=(4, 16)))
    policy = make_policy("dynarl")
    assert policy.decide(graph, drained(graph), [], now=0.0) == []
    [candidate] = policy.last_candidates
    assert candidate.recipient == "actor" and "cannot run 5 workers" in (candidate.rejected_because or "")


def test_recipient_max_workers_and_donor_min_workers_are_respected():
    graph = job(max_workers=6)
    [decision] = make_policy("dynarl").decide(graph, drained(graph), [], now=0.0)
    assert len(decision.device_ids) == 2
    graph = job(rollout_min_workers=5)
    [decision] = make_policy("dynarl").decide(graph, drained(graph), [], now=0.0)
    assert len(decision.device_ids) == 3


def test_tensor_parallel_recipient_takes_whole_workers_only():
    graph = make_graph(
        make_group("rollout", ROLLOUT, 8, first_device=0),
        make_group("actor", ACTOR, 2, first_device=50, gpus_per_worker=2),
    )
    [decision] = make_policy("dynarl").decide(graph, drained(graph, idle=5, in_flight=0), [], now=0.0)
    assert len(decision.device_ids) == 4  # 5 idle GPUs make 2 whole tp=2 workers


def test_a_tensor_parallel_recipient_gets_its_gpus_on_one_node():
    rollout = make_group("rollout", ROLLOUT, 3, first_device=0, node="na")
    other = make_group("rollout", ROLLOUT, 3, first_device=0, node="nb")
    rollout = rollout.with_workers(
        (*rollout.workers, *(Worker(f"{w.id}-b", w.devices) for w in other.workers))
    )
    graph = make_graph(rollout, make_group("actor", ACTOR, 2, first_device=50, gpus_per_worker=2))
    signals = drained(graph, idle=0, in_flight=0)
    # Idle, lowest first: one engine on each node, then a second one on node na.
    idle = ("rollout-w0", "rollout-w0-b", "rollout-w1")
    signals["rollout"] = make_signals(
        rollout, low_utilisation_workers=idle, low_utilisation_fraction=0.5 + 1e-6, in_flight=0
    )
    [decision] = make_policy("dynarl", low_fraction_threshold=0.5).decide(graph, signals, [], now=0.0)
    assert set(decision.device_ids) == {"na-g0", "na-g1"}


def test_hardware_affinity_is_respected():
    graph = job(hardware_affinity=("H800",))
    policy = make_policy("dynarl")
    assert policy.decide(graph, drained(graph), [], now=0.0) == []
    reasons = [c.rejected_because or "" for c in policy.last_candidates]
    assert reasons and all("H100" in r for r in reasons)


def test_no_move_when_the_gain_does_not_beat_the_migration_cost():
    graph = job()
    # A huge trainer state makes the p2p transfer take minutes; the horizon is 30 s.
    policy = make_policy("dynarl", model_params_b=5000.0)
    assert policy.decide(graph, drained(graph), [], now=0.0) == []
    assert all("migration cost" in (c.rejected_because or "") for c in policy.last_candidates)


def test_no_move_when_the_gain_is_under_the_hysteresis_margin():
    graph = job()
    policy = make_policy("dynarl", min_gain_ratio=2.0)  # 6 more GPUs on 4 is +150 %, under +200 %
    assert policy.decide(graph, drained(graph), [], now=0.0) == []
    assert any("min_gain_ratio" in (c.rejected_because or "") for c in policy.last_candidates)


def test_no_move_to_a_starved_recipient():
    graph = job()
    signals = drained(graph)
    # The actor waits for data (idle all window): more GPUs would sit idle too.
    signals["actor"] = make_signals(graph.node("actor"), idle=4, busy=False)
    assert make_policy("dynarl").decide(graph, signals, [], now=0.0) == []


def test_static_groups_lend_only_when_idle_and_only_if_allowed():
    graph = job()
    waiting = {
        "rollout": make_signals(
            graph.node("rollout"), queue_length=500, in_flight=32, max_in_flight_per_worker=4
        ),
        "actor": make_signals(graph.node("actor"), idle=4, busy=False),
    }
    assert make_policy("dynarl", lend_idle_static=False).decide(graph, waiting, [], now=0.0) == []
    queued = {**waiting, "actor": make_signals(graph.node("actor"), idle=4, queue_length=1)}
    assert make_policy("dynarl").decide(graph, queued, [], now=0.0) == []  # work is waiting for it
    policy = make_policy("dynarl")
    [lend] = policy.decide(graph, waiting, [], now=0.0)
    assert (lend.donor, lend.recipient) == ("actor", "rollout")
    viable = [c for c in lend.candidates if c.prediction is not None]
    assert lend.chosen is not None and lend.chosen.score == max(c.score for c in viable)
    assert max(len(c.device_ids) for c in viable) == 3  # the actor keeps one worker
    graph = land(graph, [lend])
    still_waiting = {**waiting, "actor": make_signals(graph.node("actor"), idle=1, busy=False)}
    assert policy.decide(graph, still_waiting, [], now=20.0) == []
    data_arrived = {**waiting, "actor": make_signals(graph.node("actor"), in_flight=1)}
    [back] = policy.decide(graph, data_arrived, [], now=21.0)
    assert back.reason is Reason.RETURN_BORROWED
    assert (back.donor, back.recipient) == ("rollout", "actor")
    assert set(back.device_ids) == set(lend.device_ids)


def test_borrowed_gpus_go_back_when_the_rollout_has_work_again():
    graph = job()
    policy = make_policy("dynarl")
    lent = policy.decide(graph, drained(graph), [], now=0.0)
    graph = land(graph, lent)
    working = {
        "rollout": make_signals(
            graph.node("rollout"), queue_length=200, in_flight=8, max_in_flight_per_worker=4
        ),
        "actor": make_signals(graph.node("actor"), progress=0.1),
    }
    [back] = policy.decide(graph, working, [], now=1.0)
    assert back.reason is Reason.RETURN_BORROWED
    assert (back.donor, back.recipient) == ("actor", "rollout")
    assert set(back.device_ids) == set(lent[0].device_ids)
    graph = land(graph, [back])
    assert len(graph.node("rollout").workers) == 8
    assert policy.decide(graph, working, [], now=2.0) == []  # nothing left to return


def test_borrowed_gpus_go_back_at_iteration_end_and_state_survives_a_rebuild():
    graph = job()
    policy = make_policy("dynarl")
    lent = policy.decide(graph, drained(graph), [], now=0.0)
    graph = land(graph, lent)
    rebuilt = make_policy("dynarl")
    rebuilt.load_state(json.loads(json.dumps(policy.state_to_json())))
    [back] = rebuilt.on_iteration_end(graph, now=30.0)
    assert back.reason is Reason.RETURN_BORROWED
    assert set(back.device_ids) == set(lent[0].device_ids)
    assert rebuilt.on_iteration_end(land(graph, [back]), now=31.0) == []


def test_free_devices_go_to_the_bottleneck():
    graph = job()
    signals = {
        "rollout": make_signals(graph.node("rollout"), in_flight=30, max_in_flight_per_worker=4),
        "actor": make_signals(graph.node("actor"), queue_length=3, progress=0.2),
    }
    [decision] = make_policy("dynarl").decide(graph, signals, free_devices(4), now=0.0)
    assert decision.reason is Reason.GROW_INTO_FREE_DEVICES
    assert (decision.donor, decision.recipient) == (None, "actor")
    assert len(decision.device_ids) == 4


def test_free_devices_of_refused_hardware_are_left_alone():
    graph = job(hardware_affinity=("H100",))
    signals = {
        "rollout": make_signals(graph.node("rollout"), in_flight=30, max_in_flight_per_worker=4),
        "actor": make_signals(graph.node("actor"), queue_length=3, progress=0.2),
    }
    assert make_policy("dynarl").decide(graph, signals, free_devices(4, hardware="H20"), now=0.0) == []


@pytest.mark.parametrize("progress, expected", [(0.5, 10.0), (0.25, 30.0)])
def test_the_horizon_follows_the_recipients_progress(progress: float, expected: float) -> None:
    graph = job()
    policy = make_policy("dynarl")
    policy.decide(graph, {}, [], now=0.0)  # the iteration starts at t=0
    signals = drained(graph)
    signals["actor"] = make_signals(graph.node("actor"), progress=progress)
    assert policy._horizon_s(graph.node("actor"), signals, now=10.0) == pytest.approx(expected)


def test_a_drained_rollout_keeps_lending_while_its_last_workers_look_busy():
    graph = job()
    policy = make_policy("dynarl")
    graph = land(graph, policy.decide(graph, drained(graph), [], now=0.0))
    # The two engines left run the stragglers flat out: nothing idle, nothing queued.
    stragglers = {
        "rollout": make_signals(
            graph.node("rollout"), in_flight=2, max_in_flight_per_worker=4, progress=0.97
        ),
        "actor": make_signals(graph.node("actor"), queue_length=3, progress=0.4),
    }
    assert policy.decide(graph, stragglers, [], now=20.0) == []
    # A new batch (progress restarts) is work again: the GPUs go back.
    new_batch = {**stragglers, "rollout": make_signals(graph.node("rollout"), in_flight=8, queue_length=300)}
    [back] = policy.decide(graph, new_batch, [], now=21.0)
    assert back.reason is Reason.RETURN_BORROWED


def test_gpus_a_static_group_lent_are_not_passed_on():
    inference = make_group("inference", ComponentKind.INFERENCE, 2, first_device=70, depends_on=("rollout",))
    graph = make_graph(
        make_group("rollout", ROLLOUT, 4, first_device=0),
        inference,
        make_group("actor", ACTOR, 4, first_device=50, depends_on=("inference",)),
    )
    policy = make_policy(
        "dynarl", predictor=linear_profiles({"rollout": 100.0, "inference": 300.0, "actor": 1000.0})
    )
    waiting = {
        "rollout": make_signals(
            graph.node("rollout"), queue_length=100, in_flight=16, max_in_flight_per_worker=4
        ),
        "inference": make_signals(inference, in_flight=1, progress=0.1),
        "actor": make_signals(graph.node("actor"), idle=4, busy=False),
    }
    [lend] = policy.decide(graph, waiting, [], now=0.0)
    assert (lend.donor, lend.recipient) == ("actor", "rollout")
    graph = land(graph, [lend])
    rollout = graph.node("rollout")
    # Later the rollout drains, the actor's GPUs among its idlest engines; the inference queues up.
    borrowed_first = tuple(w.id for w in rollout.workers[4:]) + tuple(w.id for w in rollout.workers[:4])
    tail = {
        "rollout": make_signals(
            rollout,
            low_utilisation_workers=borrowed_first,
            low_utilisation_fraction=1.0,
            in_flight=0,
            max_in_flight_per_worker=4,
            progress=0.9,
        ),
        "inference": make_signals(inference, queue_length=40, in_flight=2, progress=0.5),
        "actor": make_signals(graph.node("actor"), idle=1, busy=False),
    }
    [shrink] = policy.decide(graph, tail, [], now=30.0)
    assert (shrink.donor, shrink.recipient) == ("rollout", "inference")
    assert not set(shrink.device_ids) & set(lend.device_ids)


def test_recipients_are_ranked_by_their_stage():
    graph = make_graph(
        make_group("rollout-a", ROLLOUT, 3, first_device=0),
        make_group("rollout-b", ROLLOUT, 3, first_device=10),
        make_group("inference", ComponentKind.INFERENCE, 4, first_device=20),
        make_group("actor", ACTOR, 4, first_device=50),
    )
    # Each rollout group (300 tokens/s) is slower than the actor (400), but the rollout stage
    # (both groups, 600) is not: the actor is the bottleneck.
    rates = {"rollout": 100.0, "inference": 1000.0, "actor": 100.0}
    policy = make_policy("dynarl", predictor=linear_profiles(rates), max_recipients=1)
    signals = {
        "rollout-a": make_signals(graph.node("rollout-a"), queue_length=20, in_flight=8),
        "rollout-b": make_signals(graph.node("rollout-b"), queue_length=20, in_flight=8),
        "inference": make_signals(graph.node("inference"), idle=3, in_flight=1, progress=0.5),
        "actor": make_signals(graph.node("actor"), queue_length=3, progress=0.2),
    }
    [decision] = policy.decide(graph, signals, [], now=0.0)
    assert (decision.donor, decision.recipient) == ("inference", "actor")
