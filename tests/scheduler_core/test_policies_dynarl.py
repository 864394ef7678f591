import json
from dataclasses import replace
from typing import Any

import pytest

from scheduler.core.decisions import Reason
from scheduler.core.hypergraph import (
    ComponentKind,
    HyperEdge,
    Hypergraph,
    HyperNode,
    MigrationStrategy,
    Parallelism,
    Worker,
)
from scheduler.core.policies.dynarl import NOT_BEST, DynaRLPolicy
from scheduler.core.policies.moves import migration_cost_s
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
INFERENCE = ComponentKind.INFERENCE

# Tokens/s per GPU of the hand-built groups: the trainer's work per iteration is what makes the
# pipeline the bottleneck or not.
RATES = {"rollout": 1000.0, "inference": 400.0, "actor": 100.0}


def job(rollout_workers: int = 8, actor_workers: int = 4, **actor_fields: object) -> Hypergraph:
    rollout_fields = {k[len("rollout_") :]: v for k, v in actor_fields.items() if k.startswith("rollout_")}
    actor_only = {k: v for k, v in actor_fields.items() if not k.startswith("rollout_")}
    return make_graph(
        make_group("rollout", ROLLOUT, rollout_workers, first_device=0, **rollout_fields),
        make_group("actor", ACTOR, actor_workers, first_device=50, depends_on=("rollout",), **actor_only),
    )


def memory(
    *,
    tokens: float = 100_000.0,
    duration_s: float = 100.0,
    iteration: int = 0,
    batches: int = 1,
    started_at: float = 0.0,
    kv_share: float | None = None,
    batch_done: bool = False,
) -> dict[str, Any]:
    """Policy state whose pace memory has seen one earlier iteration: the trainer trained
    ``tokens`` and the rollout's previous batch took ``duration_s``, progressing linearly."""
    return {
        "pace": {
            "iteration": iteration,
            "previous_trained_tokens": tokens,
            "batches_started": batches,
            "batch_started_at": started_at,
            "batch_done": batch_done,
            "previous_curve": [duration_s * i / 50 for i in range(51)],
            "previous_duration_s": duration_s,
            "kv_share": kv_share,
        }
    }


def policy_with(state: dict[str, Any] | None = None, **params: Any) -> DynaRLPolicy:
    policy = make_policy("dynarl", predictor=linear_profiles(RATES), **params)
    assert isinstance(policy, DynaRLPolicy)
    policy.load_state(state if state is not None else memory())
    return policy


def with_episodes(graph: Hypergraph, iteration: int = 0) -> Hypergraph:
    """``graph`` with its rollout's batch of 1,000 episodes on the edge to the reward."""
    return Hypergraph(
        job_id=graph.job_id,
        nodes=graph.nodes,
        edges=(HyperEdge("rollout->reward", "rollout", "reward", 1000, 0, 0),),
        iteration=iteration,
    )


def drained(graph: Hypergraph, idle: int = 6, **fields: object) -> dict[str, GroupSignals]:
    """The rollout in its tail (``idle`` workers under U_low all window, 90% of its episodes
    done), the trainer with ready mini-batches and most of its iteration to train."""
    rollout, actor = graph.node("rollout"), graph.node("actor")
    rollout_fields: dict[str, Any] = {
        "in_flight": 4,
        "max_in_flight_per_worker": 64,
        "tokens_per_s": 500.0,
        "utilisation_mean": 0.05,
        "progress": 0.9,
        **fields,
    }
    return {
        "rollout": make_signals(rollout, idle=idle, **rollout_fields),
        "actor": make_signals(actor, queue_length=3, in_flight=1, progress=0.2),
    }


# -- Algorithm 1 -----------------------------------------------------------------------------


def test_drained_rollout_gives_its_idle_workers_to_the_bottleneck_trainer():
    graph = job()
    policy = policy_with()
    [decision] = policy.decide(graph, drained(graph), [], now=90.0)
    assert decision.reason is Reason.DONOR_LOW_UTILISATION
    assert (decision.donor, decision.recipient) == ("rollout", "actor")
    assert set(decision.device_ids) <= devices_of(graph.node("rollout"), range(6))
    assert decision.donor_strategy is MigrationStrategy.WORKLOAD
    assert decision.recipient_strategy is MigrationStrategy.P2P
    chosen = decision.chosen
    assert chosen is not None and chosen.prediction is not None
    assert chosen.prediction.job_after > chosen.prediction.job_before
    assert chosen.prediction.donor_after < chosen.prediction.donor_before  # consolidation slows it
    assert chosen.migration_cost_s > 0
    assert decision.to_json()["chosen"]["device_ids"] == list(decision.device_ids)


def test_every_candidate_is_recorded_and_the_best_predicted_one_wins():
    graph = job()
    [decision] = policy_with().decide(graph, drained(graph), [], now=90.0)
    viable = [c for c in decision.candidates if c.prediction is not None]
    assert {len(c.device_ids) for c in viable} == {1, 2, 3, 4, 5, 6}
    assert decision.chosen is not None
    assert decision.chosen.score == max(c.score for c in viable if c.rejected_because in (None, NOT_BEST))
    losers = [c for c in viable if c != decision.chosen and c.rejected_because == NOT_BEST]
    assert losers


def test_no_shrink_when_the_rollout_tail_paces_the_job():
    graph = job()
    # Little training left (a small iteration) and a long tail ahead (the previous batch took
    # 1,000 s): consolidating the stragglers would only stretch the iteration.
    policy = policy_with(memory(tokens=2_000.0, duration_s=1000.0))
    assert policy.decide(graph, drained(graph), [], now=900.0) == []
    assert policy.last_candidates
    assert all(c.rejected_because for c in policy.last_candidates)
    assert any("outweighs" in (c.rejected_because or "") for c in policy.last_candidates)


def test_a_donor_keeps_workers_enough_to_stay_out_of_the_busy_band():
    graph = job()
    # The rollout's engines run at 15% of a full engine: consolidated onto fewer than
    # 8 * 0.15 / (2 * 0.2) = 3 engines they would pass twice U_low.
    signals = drained(graph, utilisation_mean=0.15)
    [decision] = policy_with().decide(graph, signals, [], now=90.0)
    assert len(decision.device_ids) <= 5
    over = [c for c in decision.candidates if len(c.device_ids) == 6]
    assert over and over[0].rejected_because is not None


def test_no_trigger_at_or_under_the_threshold_fraction():
    graph = job()
    assert policy_with().decide(graph, drained(graph, idle=4), [], now=90.0) == []  # 0.5 is not > 0.5
    assert policy_with(low_fraction_threshold=0.4).decide(graph, drained(graph, idle=4), [], now=90.0)


def test_no_trigger_until_the_condition_is_sustained():
    graph = job()
    policy = policy_with(sustain_s=10.0)
    signals = {k: GroupSignals(**{**v.to_json(), "window_s": 2.0}) for k, v in drained(graph).items()}
    assert policy.decide(graph, signals, [], now=90.0) == []
    assert policy.decide(graph, signals, [], now=97.0) == []  # 2 s window + 7 s held
    # The tick's row says why nothing moved: which groups are idle, for how long, against what.
    assert "rollout for 9.0s (sustain_s 10s)" in policy.idle_note
    assert policy.decide(graph, signals, [], now=98.0)
    assert policy.idle_note == ""


def test_a_break_in_the_condition_restarts_the_sustain_clock():
    graph = job()
    policy = policy_with(sustain_s=10.0)
    short = {k: GroupSignals(**{**v.to_json(), "window_s": 2.0}) for k, v in drained(graph).items()}
    busy = {k: GroupSignals(**{**v.to_json(), "window_s": 2.0}) for k, v in drained(graph, idle=0).items()}
    assert policy.decide(graph, short, [], now=80.0) == []
    assert policy.decide(graph, busy, [], now=85.0) == []
    assert policy.decide(graph, short, [], now=89.0) == []  # held only since 89 s
    assert policy.decide(graph, short, [], now=97.0)


def test_a_group_with_nothing_to_do_gets_no_credit_for_the_window():
    graph = job()
    policy = policy_with(memory(tokens=0.0))
    waiting = {
        "rollout": make_signals(
            graph.node("rollout"), queue_length=64, in_flight=256, max_in_flight_per_worker=32
        ),
        "actor": make_signals(graph.node("actor"), busy=False),
    }
    # Not busy at its first sighting: it has been idle for no time at all, not for a window.
    assert policy.decide(graph, waiting, [], now=0.0) == []
    assert policy.decide(graph, waiting, [], now=5.0) == []
    assert policy.decide(graph, waiting, [], now=10.0)


def test_cooldown_blocks_a_second_move_of_the_same_group():
    graph = job()
    policy = policy_with(cooldown_s=10.0)
    [first] = policy.decide(graph, drained(graph, idle=6, utilisation_mean=0.03), [], now=90.0)
    graph = land(graph, [first])
    left = len(graph.node("rollout").workers)
    again = drained(graph, idle=left, in_flight=1, utilisation_mean=0.01)
    assert policy.decide(graph, again, [], now=95.0) == []
    assert policy.decide(graph, again, [], now=101.0)


def test_a_move_in_flight_is_not_issued_twice():
    graph = job()
    policy = policy_with(cooldown_s=0.0)
    assert policy.decide(graph, drained(graph), [], now=90.0)
    assert policy.decide(graph, drained(graph), [], now=91.0) == []  # not landed yet


def test_recipient_valid_dp_sizes_are_respected():
    graph = job(parallelism=Parallelism(valid_dp=(4, 8)))
    [decision] = policy_with().decide(graph, drained(graph), [], now=90.0)
    assert len(decision.device_ids) == 4  # 4 -> 8 workers; 5, 6 or 7 are not valid
    assert {len(c.device_ids) for c in decision.candidates} == {4}


def test_a_recipient_with_no_valid_size_is_recorded_with_the_reason():
    graph = job(parallelism=Parallelism(valid_dp=(4, 16)))
    policy = policy_with()
    assert policy.decide(graph, drained(graph), [], now=90.0) == []
    [candidate] = policy.last_candidates
    assert candidate.recipient == "actor" and "cannot run 5 workers" in (candidate.rejected_because or "")


def test_recipient_max_workers_and_donor_min_workers_are_respected():
    graph = job(max_workers=6)
    [decision] = policy_with().decide(graph, drained(graph), [], now=90.0)
    assert len(decision.device_ids) <= 2
    graph = job(rollout_min_workers=5)
    [decision] = policy_with().decide(graph, drained(graph), [], now=90.0)
    assert len(decision.device_ids) <= 3


def test_tensor_parallel_recipient_takes_whole_workers_only():
    graph = make_graph(
        make_group("rollout", ROLLOUT, 8, first_device=0),
        make_group("actor", ACTOR, 2, first_device=50, gpus_per_worker=2),
    )
    [decision] = policy_with().decide(graph, drained(graph, idle=5), [], now=90.0)
    assert len(decision.device_ids) in (2, 4)  # 5 idle GPUs make at most 2 whole tp=2 workers
    assert all(len(c.device_ids) % 2 == 0 for c in decision.candidates)


def test_a_tensor_parallel_recipient_gets_its_gpus_on_one_node():
    rollout = make_group("rollout", ROLLOUT, 3, first_device=0, node="na")
    other = make_group("rollout", ROLLOUT, 3, first_device=0, node="nb")
    rollout = rollout.with_workers(
        (*rollout.workers, *(Worker(f"{w.id}-b", w.devices) for w in other.workers))
    )
    graph = make_graph(rollout, make_group("actor", ACTOR, 2, first_device=50, gpus_per_worker=2))
    signals = drained(graph, idle=0)
    # Idle, lowest first: one engine on each node, then a second one on node na.
    idle = ("rollout-w0", "rollout-w0-b", "rollout-w1")
    signals["rollout"] = make_signals(
        rollout,
        low_utilisation_workers=idle,
        low_utilisation_fraction=0.5 + 1e-6,
        in_flight=2,
        max_in_flight_per_worker=64,
        progress=0.9,
    )
    [decision] = policy_with(low_fraction_threshold=0.5).decide(graph, signals, [], now=90.0)
    assert set(decision.device_ids) == {"na-g0", "na-g1"}


def test_hardware_affinity_is_respected():
    graph = job(hardware_affinity=("H800",))
    policy = policy_with()
    assert policy.decide(graph, drained(graph), [], now=90.0) == []
    reasons = [c.rejected_because or "" for c in policy.last_candidates]
    assert reasons and all("H100" in r for r in reasons)


def test_no_move_when_the_gain_does_not_beat_the_migration_cost():
    graph = job()
    # A huge trainer state makes the p2p transfer take minutes.
    policy = make_policy("dynarl", predictor=linear_profiles(RATES), model_params_b=5000.0)
    policy.load_state(memory())
    assert policy.decide(graph, drained(graph), [], now=90.0) == []
    assert isinstance(policy, DynaRLPolicy)
    assert all("migration cost" in (c.rejected_because or "") for c in policy.last_candidates)
    # The best of the moves it weighed, and why it lost, for the tick's row.
    assert policy.idle_note.startswith(
        f"best of {len(policy.last_candidates)} moves weighed, rollout to actor"
    )
    assert "outweighs the predicted gain" in policy.idle_note


def test_no_move_when_the_gain_is_under_the_hysteresis_margin():
    graph = job()
    policy = policy_with(min_gain_ratio=20.0)
    assert policy.decide(graph, drained(graph), [], now=90.0) == []
    assert any("min_gain_ratio" in (c.rejected_because or "") for c in policy.last_candidates)


def test_no_move_to_a_group_without_queued_work():
    graph = job()
    signals = drained(graph)
    # The trainer waits for data (nothing queued): more GPUs would sit idle too.
    signals["actor"] = make_signals(graph.node("actor"), idle=4, busy=False)
    policy = policy_with()
    assert policy.decide(graph, signals, [], now=90.0) == []


def test_recipients_are_the_groups_most_pressed_for_work():
    graph = make_graph(
        make_group("rollout", ROLLOUT, 8, first_device=0),
        make_group("inference", INFERENCE, 8, first_device=20),
        make_group("actor", ACTOR, 4, first_device=50),
    )
    signals = drained(graph)
    # Both pipeline groups have work queued; the trainer has far more work per GPU left.
    signals["inference"] = make_signals(graph.node("inference"), queue_length=2, in_flight=8, progress=0.9)
    [decision] = policy_with(max_recipients=1).decide(graph, signals, [], now=90.0)
    assert decision.recipient == "actor"
    assert {c.recipient for c in decision.candidates} == {"actor"}


# -- static lenders and returns ----------------------------------------------------------------


def pipeline_job() -> Hypergraph:
    return make_graph(
        make_group("rollout", ROLLOUT, 4, first_device=0),
        make_group("inference", INFERENCE, 2, first_device=70, depends_on=("rollout",)),
        make_group("actor", ACTOR, 4, first_device=50, depends_on=("inference",)),
    )


def test_an_idle_trainer_lends_to_a_backlogged_stage_only_if_allowed():
    graph = pipeline_job()
    signals = {
        "rollout": make_signals(
            graph.node("rollout"), in_flight=64, max_in_flight_per_worker=64, progress=0.3
        ),
        "inference": make_signals(graph.node("inference"), queue_length=40, in_flight=2, progress=0.1),
        "actor": make_signals(graph.node("actor"), idle=4, busy=False),
    }
    assert policy_with(lend_idle_static=False).decide(graph, signals, [], now=50.0) == []
    queued = {**signals, "actor": make_signals(graph.node("actor"), idle=4, queue_length=1)}
    assert policy_with().decide(graph, queued, [], now=50.0) == []  # work is waiting for it
    policy = policy_with()
    [lend] = policy.decide(graph, signals, [], now=50.0)
    assert (lend.donor, lend.recipient) == ("actor", "inference")
    assert max(len(c.device_ids) for c in lend.candidates) == 3  # the trainer keeps one worker


def test_borrowed_gpus_go_back_when_the_lender_is_the_bottleneck_again():
    graph = job()
    policy = policy_with(cooldown_s=0.0)
    [lent] = policy.decide(graph, drained(graph), [], now=90.0)
    graph = land(graph, [lent])
    # The rollout generates ahead of the trainer (asynchronous RL): its next batch is queued
    # behind the few engines it kept, while the trainer is nearly through its iteration.
    state = policy.state_to_json()
    state["pace"] = memory(tokens=10_000.0, batches=2, started_at=95.0)["pace"]
    policy.load_state(state)
    graph = with_episodes(graph)
    working = {
        "rollout": make_signals(
            graph.node("rollout"),
            queue_length=2000,
            in_flight=128,
            max_in_flight_per_worker=64,
            tokens_per_s=2000.0,
            utilisation_mean=1.0,
            progress=0.0,
        ),
        "actor": make_signals(graph.node("actor"), in_flight=1, progress=0.9),
    }
    [back] = policy.decide(graph, working, [], now=96.0)
    assert back.reason is Reason.RETURN_BORROWED
    assert (back.donor, back.recipient) == ("actor", "rollout")
    assert set(back.device_ids) == set(lent.device_ids)
    assert back.chosen is not None and back.chosen.prediction is not None
    assert back.chosen.prediction.job_after > back.chosen.prediction.job_before
    graph = land(graph, [back])
    assert len(graph.node("rollout").workers) == 8
    assert policy.decide(graph, working, [], now=97.0) == []  # nothing left to return


def finished_borrower(actor_queue: int) -> tuple[DynaRLPolicy, Hypergraph, dict[str, GroupSignals]]:
    """The log-prob group has finished its share of a synchronous iteration with two GPUs the
    rollout (done with its batch) lent it; the trainer has ``actor_queue`` mini-batches waiting."""
    graph = pipeline_job()
    policy = policy_with(cooldown_s=0.0)
    policy.loans.lend("rollout", "inference", ["n0-g0", "n0-g1"], at=10.0)
    graph = land(graph, [_decision_moving("rollout", "inference", ["n0-g0", "n0-g1"])])
    policy.memory.batch_done = True
    busy = {"queue_length": actor_queue, "in_flight": 1} if actor_queue else {"busy": False}
    done = {
        "rollout": make_signals(graph.node("rollout"), idle=2, busy=False, progress=1.0),
        "inference": make_signals(graph.node("inference"), idle=4, progress=1.0),
        "actor": make_signals(graph.node("actor"), progress=0.7, **busy),
    }
    return policy, graph, done


def test_a_finished_borrower_sends_a_synchronous_rollouts_gpus_home_before_the_next_batch():
    policy, graph, done = finished_borrower(actor_queue=0)
    [home] = policy.decide(graph, done, [], now=100.0)
    assert home.reason is Reason.RETURN_BORROWED
    assert (home.donor, home.recipient) == ("inference", "rollout")
    assert set(home.device_ids) == {"n0-g0", "n0-g1"}


def test_a_finished_borrower_passes_the_gpus_on_to_a_trainer_with_work_waiting():
    # The next batch cannot start before the trainer is done: the GPUs serve it meanwhile,
    # in one move instead of two (home, then from the rollout to the trainer).
    policy, graph, done = finished_borrower(actor_queue=2)
    [move] = policy.decide(graph, done, [], now=100.0)
    assert move.reason is Reason.DONOR_LOW_UTILISATION
    assert (move.donor, move.recipient) == ("inference", "actor")
    assert {"n0-g0", "n0-g1"} & set(move.device_ids)
    assert any(loan.borrower == "actor" and loan.lender == "rollout" for loan in policy.loans.loans)


def test_a_finished_borrower_keeps_the_gpus_for_a_trainer_that_has_just_started_its_last_mini_batch():
    # The trainer's windowed utilisation has not caught up with its start yet; its running work
    # has. Sent home now, the GPUs would sit on a rollout with nothing to generate, and the return
    # would hold both groups in their cooldown while the trainer trains on the GPUs it has.
    policy, graph, done = finished_borrower(actor_queue=0)
    done["actor"] = make_signals(
        graph.node("actor"), in_flight=1, utilisation_mean=0.05, utilisation_p50=0.05, progress=0.9
    )
    assert not any(d.reason is Reason.RETURN_BORROWED for d in policy.decide(graph, done, [], now=100.0))


def test_a_borrower_with_work_left_keeps_the_gpus_until_iteration_end():
    graph = pipeline_job()
    policy = policy_with(cooldown_s=0.0)
    policy.loans.lend("rollout", "inference", ["n0-g0", "n0-g1"], at=10.0)
    graph = land(graph, [_decision_moving("rollout", "inference", ["n0-g0", "n0-g1"])])
    policy.memory.batch_done = True
    between = {
        "rollout": make_signals(graph.node("rollout"), idle=2, busy=False, progress=1.0),
        "inference": make_signals(graph.node("inference"), idle=4, progress=0.8),
        "actor": make_signals(graph.node("actor"), queue_length=2, in_flight=1, progress=0.7),
    }
    policy.decide(graph, between, [], now=100.0)
    assert not any(d.reason is Reason.RETURN_BORROWED for d in policy.decide(graph, between, [], now=111.0))


def test_borrowed_gpus_go_back_at_a_synchronous_iteration_end_and_state_survives_a_rebuild():
    graph = job()
    policy = policy_with()
    [lent] = policy.decide(graph, drained(graph), [], now=90.0)
    graph = land(graph, [lent])
    rebuilt = policy_with({})
    rebuilt.load_state(json.loads(json.dumps(policy.state_to_json())))
    next_iteration = Hypergraph(job_id=graph.job_id, nodes=graph.nodes, iteration=1)
    [back] = rebuilt.on_iteration_end(next_iteration, now=130.0)
    assert back.reason is Reason.RETURN_BORROWED
    assert set(back.device_ids) == set(lent.device_ids)
    assert rebuilt.on_iteration_end(land(next_iteration, [back]), now=131.0) == []


def next_batch_queued(graph: Hypergraph) -> dict[str, GroupSignals]:
    """The iteration boundary: the rollout's few engines hold the whole new batch, the trainer
    waits for its first mini-batch."""
    rollout, actor = graph.node("rollout"), graph.node("actor")
    return {
        "rollout": make_signals(
            rollout,
            queue_length=4000,
            in_flight=64,
            max_in_flight_per_worker=64,
            progress=0.0,
            utilisation_mean=0.9,
        ),
        "actor": make_signals(actor, idle=len(actor.workers), busy=False, progress=0.0, utilisation_mean=0.0),
    }


def test_live_iteration_end_keeps_a_loan_the_pace_model_says_would_cost_more_than_it_gains():
    graph = job()
    policy = policy_with()
    [lent] = policy.decide(graph, drained(graph), [], now=90.0)
    graph = land(graph, [lent])
    state = json.loads(json.dumps(policy.state_to_json()))
    boundary = Hypergraph(job_id=graph.job_id, nodes=graph.nodes, iteration=1)
    # The trainer is this job's bottleneck: shrinking it back for the rollout's next batch would
    # finish the iteration later. Live (signals given) the loan stays, for the ticks to weigh...
    live = policy_with(state)
    assert live.on_iteration_end(boundary, now=130.0, signals=next_batch_queued(boundary)) == []
    assert live.loans.outstanding(lender="rollout")
    # ...while the simulator's rule (no signals) sends every loan home.
    [back] = policy_with(state).on_iteration_end(boundary, now=130.0)
    assert set(back.device_ids) == set(lent.device_ids)


def test_live_iteration_end_always_returns_to_a_lender_left_without_workers():
    graph, signals = finished_stages()
    policy = policy_with(memory(batch_done=True))
    for now in (90.0, 92.0):
        [leg] = policy.decide(graph, signals, [], now=now)
        graph = land(graph, [leg])
    assert not graph.node("rollout").workers and not graph.node("inference").workers
    back = policy.on_iteration_end(replace(graph, iteration=1), now=120.0, signals=signals)
    assert sorted((d.recipient, len(d.device_ids)) for d in back) == [("inference", 4), ("rollout", 4)]


def test_nothing_goes_home_at_iteration_end_when_the_rollout_generates_ahead():
    graph = job()
    policy = policy_with()
    [lent] = policy.decide(graph, drained(graph), [], now=90.0)
    graph = land(graph, [lent])
    policy.memory.batches_started = 2  # the rollout already works on the next iteration's batch
    next_iteration = Hypergraph(job_id=graph.job_id, nodes=graph.nodes, iteration=1)
    assert policy.on_iteration_end(next_iteration, now=130.0) == []
    assert policy.loans.outstanding(lender="rollout")


def idle_log_probs_beside_a_queued_rollout(
    log_prob_progress: float,
) -> tuple[Hypergraph, dict[str, GroupSignals]]:
    """A synchronous iteration's rollout with requests queued; a log-prob group idle for now,
    with ``1 - log_prob_progress`` of the iteration's log-probs still to come from the rollout."""
    graph = make_graph(
        make_group("rollout", ROLLOUT, 4, first_device=0),
        make_group("inference", INFERENCE, 8, first_device=20, depends_on=("rollout",)),
        make_group("actor", ACTOR, 4, first_device=50, depends_on=("inference",)),
    )
    graph = with_episodes(graph)
    signals = {
        "rollout": make_signals(
            graph.node("rollout"),
            queue_length=600,
            in_flight=200,
            max_in_flight_per_worker=50,
            tokens_per_s=4000.0,
            utilisation_mean=1.0,
            progress=0.2,
        ),
        "inference": make_signals(
            graph.node("inference"), idle=8, utilisation_mean=0.0, progress=log_prob_progress, busy=False
        ),
        "actor": make_signals(graph.node("actor"), progress=0.0, busy=False),
    }
    return graph, signals


def test_a_log_prob_group_with_work_to_come_lends_the_rollout_gpus_it_will_pay_to_take_back():
    scores = {}
    for progress in (0.2, 1.0):
        graph, signals = idle_log_probs_beside_a_queued_rollout(progress)
        policy = policy_with(memory(tokens=20_000.0, duration_s=100.0))
        # Done for the iteration, the group lends at once; with work to come, once its
        # idleness has held for sustain_s.
        [decision] = policy.decide(graph, signals, [], now=1.0) or policy.decide(graph, signals, [], now=11.0)
        assert (decision.donor, decision.recipient) == ("inference", "rollout")
        assert decision.chosen is not None
        scores[progress] = (decision.chosen.score, len(decision.device_ids))
    # With log-probs still to come the GPUs must come back to the log-prob group before the
    # iteration ends: the move's cost counts twice, once for each way, over the job's 16 GPUs.
    (with_work, moved), (done, moved_done) = scores[0.2], scores[1.0]
    assert moved == moved_done
    back_s = migration_cost_s(policy.cost_model, graph.node("rollout"), graph.node("inference"), moved)
    assert with_work == pytest.approx(done - moved * back_s / 16)


# -- pace rebalancing ---------------------------------------------------------------------------


def behind_rollout() -> tuple[Hypergraph, dict[str, GroupSignals]]:
    """A rollout with a new batch queued behind a few engines; a log-prob group with slack."""
    graph = make_graph(
        make_group("rollout", ROLLOUT, 2, first_device=0),
        make_group("inference", INFERENCE, 8, first_device=20),
        make_group("actor", ACTOR, 4, first_device=50),
    )
    graph = with_episodes(graph, iteration=1)
    signals = {
        "rollout": make_signals(
            graph.node("rollout"),
            queue_length=900,
            in_flight=100,
            max_in_flight_per_worker=50,
            tokens_per_s=2000.0,
            utilisation_mean=1.0,
            progress=0.0,
        ),
        "inference": make_signals(
            graph.node("inference"), in_flight=2, utilisation_mean=0.3, progress=0.9, window_s=10.0
        ),
        "actor": make_signals(graph.node("actor"), in_flight=1, queue_length=1, progress=0.5),
    }
    return graph, signals


def test_a_working_group_gives_a_rollout_that_fell_behind_workers_once_sustained():
    graph, signals = behind_rollout()
    policy = policy_with(memory(tokens=20_000.0, iteration=1, batches=3, started_at=0.0))
    assert policy.decide(graph, signals, [], now=1.0) == []  # the imbalance is new
    assert policy.decide(graph, signals, [], now=10.0) == []
    [decision] = policy.decide(graph, signals, [], now=11.0)
    assert decision.reason is Reason.BORROW_IDLE_POOL
    assert (decision.donor, decision.recipient) == ("inference", "rollout")
    assert decision.chosen is not None and decision.chosen.prediction is not None
    assert decision.chosen.prediction.job_after > 1.2 * decision.chosen.prediction.job_before


def test_rebalancing_can_be_switched_off():
    graph, signals = behind_rollout()
    policy = policy_with(memory(tokens=20_000.0, iteration=1, batches=3), rebalance_gain_ratio=0.0)
    assert policy.decide(graph, signals, [], now=1.0) == []
    assert policy.decide(graph, signals, [], now=20.0) == []


def backlogged_log_probs(rollout_progress: float) -> tuple[Hypergraph, dict[str, GroupSignals]]:
    """A synchronous iteration: a rollout still busy (none of its engines under U_low), a log-prob
    group whose queue holds most of the iteration's work on 2 GPUs, a trainer on what reached it."""
    graph = make_graph(
        make_group("rollout", ROLLOUT, 8, first_device=0),
        make_group("inference", INFERENCE, 2, first_device=20),
        make_group("actor", ACTOR, 8, first_device=50),
    )
    graph = with_episodes(graph)
    signals = {
        "rollout": make_signals(
            graph.node("rollout"),
            idle=0,
            in_flight=40,
            max_in_flight_per_worker=64,
            tokens_per_s=4000.0,
            utilisation_mean=0.15,
            progress=rollout_progress,
        ),
        "inference": make_signals(
            graph.node("inference"), queue_length=40, in_flight=2, utilisation_mean=1.0, progress=0.1
        ),
        "actor": make_signals(graph.node("actor"), in_flight=1, queue_length=1, progress=0.8),
    }
    return graph, signals


def test_a_log_prob_backlog_that_outlasts_the_rollout_takes_rollout_workers_once_sustained():
    # 225 GPU-seconds of log-probs queued on 2 GPUs against the rollout's last ~20 seconds: the
    # log-prob group paces the iteration's end whatever the rollout does, so the working rollout
    # gives it engines (consolidating its stragglers) once the imbalance has held for sustain_s.
    graph, signals = backlogged_log_probs(rollout_progress=0.8)
    policy = policy_with(memory(duration_s=100.0))
    assert policy.decide(graph, signals, [], now=80.0) == []  # the imbalance is new
    [decision] = policy.decide(graph, signals, [], now=90.0)
    assert decision.reason is Reason.BORROW_IDLE_POOL
    assert (decision.donor, decision.recipient) == ("rollout", "inference")
    assert decision.chosen is not None and decision.chosen.prediction is not None
    assert decision.chosen.prediction.job_after > decision.chosen.prediction.job_before

    # Early in the batch most of the log-prob work has not arrived: its queue says little yet.
    graph, early = backlogged_log_probs(rollout_progress=0.5)
    policy = policy_with(memory(duration_s=100.0))
    assert policy.decide(graph, early, [], now=50.0) == []
    assert policy.decide(graph, early, [], now=65.0) == []
    # Nor is the rollout's remaining time known before a whole batch was seen.
    policy = policy_with({})
    assert policy.decide(graph, signals, [], now=80.0) == []
    assert policy.decide(graph, signals, [], now=95.0) == []


# -- free devices, placement ---------------------------------------------------------------------


def test_free_devices_go_to_the_bottleneck():
    graph = job()
    signals = drained(graph, idle=0)
    [decision] = policy_with().decide(graph, signals, free_devices(4), now=90.0)
    assert decision.reason is Reason.GROW_INTO_FREE_DEVICES
    assert (decision.donor, decision.recipient) == (None, "actor")
    assert len(decision.device_ids) == 4


def test_free_devices_of_refused_hardware_are_left_alone():
    graph = job(hardware_affinity=("H100",))
    signals = drained(graph, idle=0)
    assert policy_with().decide(graph, signals, free_devices(4, hardware="H20"), now=90.0) == []


def test_the_initial_split_gives_the_trainers_gpus_to_the_groups_with_work_from_the_start():
    groups = [
        make_group(
            "actor",
            ACTOR,
            8,
            first_device=0,
            gpus_per_worker=2,
            parallelism=Parallelism(tp=2, valid_dp=(1, 2, 4, 8)),
        ),
        make_group("rollout", ROLLOUT, 36, first_device=16),
        make_group(
            "inference", INFERENCE, 6, first_device=52, gpus_per_worker=2, parallelism=Parallelism(tp=2)
        ),
    ]
    split = policy_with().plan_initial_split(64, groups)
    # The trainer keeps one tp=2 worker; 14 GPUs go 36:12 (10.5 and 3.5 of them), the log-prob
    # group's share rounded to whole workers (4), the rollout taking the rest (10).
    assert split == {"actor": 2, "rollout": 46, "inference": 16}
    assert sum(split.values()) == 64


def test_the_initial_split_keeps_the_spec_without_a_trainer_or_a_rollout():
    rollout_only = [make_group("rollout", ROLLOUT, 8, first_device=0)]
    assert policy_with().plan_initial_split(8, rollout_only) is None


@pytest.mark.parametrize("bad", [0, -8])
def test_the_initial_split_needs_gpus(bad: int) -> None:
    with pytest.raises(ValueError):
        policy_with().plan_initial_split(bad, [make_group("rollout", ROLLOUT, 8, first_device=0)])


def _decision_moving(donor: str, recipient: str, device_ids: list[str]) -> Any:
    from scheduler.core.decisions import Decision

    return Decision(
        policy="dynarl",
        reason=Reason.OPERATOR_REQUEST,
        detail="test",
        donor=donor,
        recipient=recipient,
        device_ids=tuple(device_ids),
        donor_strategy=None,
        recipient_strategy=None,
    )


# -- pooled moves ------------------------------------------------------------------------------


DONE = {"in_flight": 0, "progress": 1.0, "busy": False, "utilisation_mean": 0.0}


def trainer(group_id: str, workers: int, first_device: int) -> HyperNode:
    """A trainer of 1-GPU ranks fed by the log-prob group, at power-of-two sizes only."""
    return make_group(
        group_id,
        ACTOR,
        workers,
        first_device=first_device,
        depends_on=("inference",),
        parallelism=Parallelism(valid_dp=(1, 2, 4, 8, 16)),
    )


def finished_stages(actor_workers: int = 8, *others: HyperNode) -> tuple[Hypergraph, dict[str, GroupSignals]]:
    """A synchronous iteration after its rollout and log-probs are done: both groups idle and
    allowed to give up every worker; the trainer (``actor_workers`` ranks) has half its
    iteration left and mini-batches ready. ``others``: more groups, their signals to be added."""
    graph = make_graph(
        make_group("rollout", ROLLOUT, 4, first_device=0, min_workers=0),
        make_group("inference", INFERENCE, 4, first_device=20, min_workers=0, depends_on=("rollout",)),
        trainer("actor", actor_workers, first_device=40),
        *others,
    )
    signals = {
        "rollout": make_signals(graph.node("rollout"), idle=4, max_in_flight_per_worker=64, **DONE),
        "inference": make_signals(graph.node("inference"), idle=4, **DONE),
        "actor": make_signals(graph.node("actor"), queue_length=3, in_flight=1, progress=0.5),
    }
    return graph, signals


def test_drained_groups_pool_their_gpus_when_no_single_one_reaches_a_valid_trainer_size():
    graph, signals = finished_stages()
    policy = policy_with(memory(batch_done=True))
    [first] = policy.decide(graph, signals, [], now=90.0)
    # 8 -> 16 ranks takes the 4 GPUs of both groups; either alone leaves 12 ranks.
    assert first.reason is Reason.DONOR_LOW_UTILISATION and first.recipient == "actor"
    assert "pool" in first.detail
    chosen = first.chosen
    assert chosen is not None and len(chosen.device_ids) == 8
    assert chosen.prediction is not None and chosen.prediction.job_after > chosen.prediction.job_before
    assert len(first.device_ids) == 4 and set(first.device_ids) < set(chosen.device_ids)
    assert all(c.rejected_because for c in first.candidates if len(c.device_ids) == 4)
    # One migration at a time: the next leg waits until the first has landed...
    assert policy.decide(graph, signals, [], now=91.0) == []
    graph = land(graph, [first])
    [second] = policy.decide(graph, signals, [], now=92.0)
    assert {first.donor, second.donor} == {"rollout", "inference"}
    assert second.recipient == "actor"
    assert set(first.device_ids) | set(second.device_ids) == set(chosen.device_ids)
    graph = land(graph, [second])
    assert len(graph.node("actor").workers) == 16
    # ...and every GPU is owed to its group, to come back at the iteration's end.
    back = policy.on_iteration_end(replace(graph, iteration=1), now=120.0)
    assert sorted((d.recipient, len(d.device_ids)) for d in back) == [("inference", 4), ("rollout", 4)]


def test_a_group_done_with_its_share_lends_again_within_its_cooldown():
    # A synchronous rollout with its batch done has nothing its signals could still be settling
    # on: the cooldown that spaces out moves of a group whose load is changing does not hold it
    # back from feeding a second trainer right after the first.
    graph = make_graph(
        make_group("rollout", ROLLOUT, 16, first_device=0, min_workers=0),
        trainer("actor", 8, first_device=40),
        trainer("critic", 8, first_device=60),
    )
    waiting = {"queue_length": 3, "in_flight": 1, "progress": 0.5}
    signals = {
        "rollout": make_signals(graph.node("rollout"), idle=16, max_in_flight_per_worker=64, **DONE),
        "actor": make_signals(graph.node("actor"), **waiting),
        "critic": make_signals(graph.node("critic"), **waiting),
    }
    policy = policy_with(memory(batch_done=True), cooldown_s=10.0)
    [first] = policy.decide(graph, signals, [], now=90.0)
    assert first.donor == "rollout" and len(first.device_ids) == 8
    graph = land(graph, [first])
    signals["rollout"] = make_signals(graph.node("rollout"), idle=8, max_in_flight_per_worker=64, **DONE)
    [second] = policy.decide(graph, signals, [], now=92.0)
    assert second.donor == "rollout" and {first.recipient, second.recipient} == {"actor", "critic"}

    # A rollout still decoding its last requests waits out the cooldown.
    graph = land(graph, [second])
    busy = policy_with(memory(), cooldown_s=10.0)
    tail = drained(job())
    [lent] = busy.decide(job(), tail, [], now=90.0)
    after = land(job(), [lent])
    assert busy.decide(after, drained(after, idle=len(after.node("rollout").workers)), [], now=92.0) == []


def test_a_trainer_that_just_grew_takes_more_from_groups_done_with_their_share_within_its_cooldown():
    # The trainer grew a moment ago (its cooldown runs) and more of its mini-batches are ready:
    # the GPUs of groups done with the iteration cannot bounce back to them before it ends, so
    # the trainer's cooldown does not hold them idle, pooled or not.
    graph, signals = finished_stages()
    policy = policy_with(memory(batch_done=True), cooldown_s=10.0)
    policy.cooldowns.mark(["actor"], now=88.0)
    [first] = policy.decide(graph, signals, [], now=90.0)
    assert first.recipient == "actor" and "pool" in first.detail

    # Lent by a rollout still decoding its tail, they wait for the trainer's cooldown to pass.
    cooling = policy_with(memory(), cooldown_s=10.0)
    cooling.cooldowns.mark(["actor"], now=88.0)
    assert cooling.decide(job(), drained(job()), [], now=90.0) == []
    assert policy_with(memory(), cooldown_s=10.0).decide(job(), drained(job()), [], now=90.0) != []


def test_gpus_a_trainer_lent_go_home_in_a_pooled_move_when_no_return_alone_reaches_a_valid_size():
    graph, signals = finished_stages()
    policy = policy_with(memory(batch_done=True))
    # The trainer owns 2 ranks, lent to the log-prob group while it waited for samples; the 8 it
    # trains on are the rollout's.
    own = ["n0-g20", "n0-g21"]
    policy.loans.lend("actor", "inference", own, at=70.0)
    policy.loans.lend("rollout", "actor", [f"n0-g{40 + i}" for i in range(8)], at=80.0)
    # Taking back only its own leaves it at 10 ranks, the other idle GPUs without them at 14:
    # the pool of every idle GPU, its own included, is its one way to 16.
    [first] = policy.decide(graph, signals, [], now=90.0)
    assert first.reason is Reason.DONOR_LOW_UTILISATION and first.recipient == "actor"
    chosen = first.chosen
    assert chosen is not None and set(own) <= set(chosen.device_ids) and len(chosen.device_ids) == 8
    graph = land(graph, [first])
    [second] = policy.decide(graph, signals, [], now=92.0)
    graph = land(graph, [second])
    assert len(graph.node("actor").workers) == 16
    # Its own GPUs came home: at the iteration's end it gives back the rest and keeps them.
    back = policy.on_iteration_end(replace(graph, iteration=1), now=120.0)
    assert sorted((d.recipient, len(d.device_ids)) for d in back) == [("inference", 2), ("rollout", 12)]
    assert not set(own) & {d for decision in back for d in decision.device_ids}


def test_a_trainer_is_given_the_other_idle_gpus_before_its_own_lent_ones():
    graph, signals = finished_stages(2)
    signals["rollout"] = make_signals(
        graph.node("rollout"), max_in_flight_per_worker=64, in_flight=40, progress=0.6, busy=True
    )
    policy = policy_with(memory(batch_done=True))
    # One of the log-prob group's GPUs is the trainer's: taking back only that leaves 3 ranks.
    policy.loans.lend("actor", "inference", ["n0-g20"], at=70.0)
    [move] = policy.decide(graph, signals, [], now=90.0)
    # 2 -> 4 ranks takes two of the log-prob group's own idle GPUs; the trainer's stays owed, to
    # come back when a move needs it (as in the pooled move above) or at a valid return.
    assert move.reason is Reason.DONOR_LOW_UTILISATION, move
    assert move.recipient == "actor" and move.donor == "inference"
    assert len(move.device_ids) == 2 and "n0-g20" not in move.device_ids


def test_gpus_a_trainer_lent_are_not_pooled_for_another_group():
    graph, signals = finished_stages(8, trainer("trainer", 8, first_device=60))
    waiting = {"in_flight": 0, "progress": 0.0, "busy": False, "utilisation_mean": 0.0}
    signals["trainer"] = make_signals(graph.node("trainer"), idle=8, **waiting)
    policy = policy_with(memory(batch_done=True))
    policy.loans.lend("trainer", "inference", ["n0-g20", "n0-g21"], at=80.0)
    decisions = policy.decide(graph, signals, [], now=90.0)
    # The working trainer may pool the idle groups' own GPUs, never the other trainer's.
    moved = {d for decision in decisions for d in decision.device_ids}
    chosen = {d for decision in decisions if decision.chosen for d in decision.chosen.device_ids}
    assert not {"n0-g20", "n0-g21"} & (moved | chosen)


def test_a_group_holding_only_gpus_lent_by_another_trainer_takes_no_place_in_a_pooled_move():
    ref = make_group("ref", INFERENCE, 4, first_device=30, min_workers=0, depends_on=("rollout",))
    graph, signals = finished_stages(8, trainer("trainer", 8, first_device=60), ref)
    waiting = {"in_flight": 0, "progress": 0.0, "busy": False, "utilisation_mean": 0.0}
    signals["trainer"] = make_signals(graph.node("trainer"), idle=8, **waiting)
    signals["ref"] = make_signals(ref, idle=4, **DONE)
    policy = policy_with(memory(batch_done=True))
    # Every idle GPU of the log-prob group is the other trainer's: the pool is the rollout's
    # and the reference group's.
    policy.loans.lend("trainer", "inference", [f"n0-g{20 + i}" for i in range(4)], at=80.0)
    [first] = policy.decide(graph, signals, [], now=90.0)
    assert first.recipient == "actor" and first.chosen is not None
    pooled = devices_of(graph.node("rollout"), range(4)) | devices_of(ref, range(4))
    assert set(first.chosen.device_ids) == pooled


def test_a_pooled_move_survives_a_restart_of_the_policy_and_is_dropped_when_its_gpus_move_away():
    graph, signals = finished_stages()
    policy = policy_with(memory(batch_done=True))
    [first] = policy.decide(graph, signals, [], now=90.0)
    graph = land(graph, [first])
    restarted = policy_with(json.loads(json.dumps(policy.state_to_json())))
    [second] = restarted.decide(graph, signals, [], now=92.0)
    assert second.donor != first.donor and second.recipient == "actor"
    # Had the second donor's GPUs gone elsewhere meanwhile (released to the free pool), the
    # rest of the plan is dropped instead of asking for devices the donor no longer holds.
    other = policy_with(json.loads(json.dumps(policy.state_to_json())))
    released = land(graph, [replace(second, recipient=None)])
    assert other.decide(released, signals, [], now=92.0) == []
    assert other.state_to_json()["plan"] == []


def test_groups_done_with_a_synchronous_iteration_lend_without_sitting_out_the_trigger():
    graph, signals = finished_stages()
    # The rollout and log-prob groups finished two seconds ago: no window vouches for them yet.
    short = {g: replace(s, window_s=2.0) if g != "actor" else s for g, s in signals.items()}
    done = policy_with(memory(batch_done=True))
    [first] = done.decide(graph, short, [], now=90.0)
    assert first.recipient == "actor" and first.donor in ("rollout", "inference")
    # While the rollout still decodes its last requests, more samples may reach the log-prob
    # group: a two-second lull is sat out (``sustain_s``).
    tail = dict(short, rollout=replace(short["rollout"], in_flight=2, progress=0.98, busy=True))
    lull = policy_with(memory(batch_done=False))
    assert lull.decide(graph, tail, [], now=90.0) == []


def test_gpus_lent_by_a_group_left_without_workers_go_home_in_the_next_iteration():
    graph, signals = finished_stages()
    policy = policy_with(memory(batch_done=True))
    [first] = policy.decide(graph, signals, [], now=90.0)
    graph = land(graph, [first])
    [second] = policy.decide(graph, signals, [], now=92.0)
    # The iteration ends before the second leg lands: its loan is still in transit at the
    # boundary, so the iteration-end returns cannot send it home.
    nxt = replace(graph, iteration=1)
    back = policy.on_iteration_end(nxt, now=93.0)
    assert second.donor not in {d.recipient for d in back}
    landed = land(nxt, [second, *back])
    emptied = second.donor
    assert emptied is not None and not landed.node(emptied).workers
    # Once it has landed, the next tick sends it home: the group has work in this iteration.
    working = {g: replace(s, progress=0.0) for g, s in signals.items()}
    [home] = policy.decide(landed, working, [], now=140.0)
    assert home.reason is Reason.RETURN_BORROWED and home.recipient == emptied
    assert set(home.device_ids) == set(second.device_ids)
