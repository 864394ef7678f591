"""The pace model behind dynarl: what it remembers of a job and what it predicts."""

import json
import math

import pytest

from scheduler.core.hypergraph import ComponentKind, HyperEdge, Hypergraph, Parallelism
from scheduler.core.policies.pace import (
    CURVE_POINTS,
    PaceMemory,
    PaceModel,
    RolloutView,
    consolidation_slowdown,
    kv_read_share,
    largest_valid_gpus,
    rollout_view,
)
from scheduler.core.signals import GroupSignals
from tests.scheduler_core.test_policies_fixtures import linear_profiles, make_graph, make_group, make_signals

ROLLOUT = ComponentKind.ROLLOUT
ACTOR = ComponentKind.ACTOR
INFERENCE = ComponentKind.INFERENCE


def job(iteration: int = 0, rollout: int = 8, actor: int = 4, inference: int = 0) -> Hypergraph:
    groups = [
        make_group("rollout", ROLLOUT, rollout, first_device=0),
        make_group("actor", ACTOR, actor, first_device=50),
    ]
    if inference:
        groups.append(make_group("inference", INFERENCE, inference, first_device=80))
    graph = make_graph(*groups)
    return Hypergraph(
        job_id=graph.job_id,
        nodes=graph.nodes,
        edges=(HyperEdge("rollout->reward", "rollout", "reward", 1000, 0, 0),),
        iteration=iteration,
    )


def tick(
    graph: Hypergraph,
    *,
    progress: float,
    in_flight: int = 100,
    queue: int = 0,
    rollout_tokens: float = 1000.0,
    trainer_tokens: float = 0.0,
) -> dict[str, GroupSignals]:
    return {
        "rollout": make_signals(
            graph.node("rollout"),
            progress=progress,
            in_flight=in_flight,
            queue_length=queue,
            tokens_per_s=rollout_tokens,
            max_in_flight_per_worker=64,
            utilisation_mean=0.5,
        ),
        "actor": make_signals(graph.node("actor"), tokens_per_s=trainer_tokens, in_flight=1, progress=0.5),
    }


def view(**fields: object) -> RolloutView:
    base: dict[str, object] = {
        "gpus": 8,
        "workers": 8,
        "in_flight": 16,
        "queue_length": 0,
        "progress": 0.9,
        "utilisation": 0.1,
        "tokens_per_s": 1000.0,
        "max_in_flight_per_worker": 64,
    }
    base.update(fields)
    return RolloutView(**base)  # type: ignore[arg-type]


# -- memory ------------------------------------------------------------------------------------


def test_a_synchronous_rollout_batch_is_timed_from_its_start_to_its_last_episode():
    memory = PaceMemory()
    graph = job()
    memory.observe(graph, tick(graph, progress=0.0), now=1.0)
    memory.observe(graph, tick(graph, progress=0.5), now=21.0)
    assert not memory.batch_done
    memory.observe(graph, tick(graph, progress=1.0, in_flight=0), now=41.0)
    assert memory.batch_done and memory.batches_started == 1
    assert memory.previous_duration_s == pytest.approx(40.0)
    assert len(memory.previous_curve) == CURVE_POINTS + 1
    assert memory.previous_curve[CURVE_POINTS // 2] == pytest.approx(20.0)
    # The next iteration's batch: the progress restarts.
    after = job(iteration=1)
    memory.observe(after, tick(after, progress=0.0), now=50.0)
    assert memory.batches_started == 2 and not memory.batch_done
    assert memory.batches_ahead(1) == 0
    assert not memory.generating_ahead(2)


def test_a_batch_seen_by_its_requests_before_its_progress_is_counted_once():
    # On a loaded control plane the next batch's requests show before the progress the engines
    # report restarts (it still reads the last batch's end): that is one batch, not two, and a
    # synchronous job must not look as if it generated ahead.
    memory = PaceMemory()
    graph = job()
    memory.observe(graph, tick(graph, progress=0.0), now=1.0)
    memory.observe(graph, tick(graph, progress=1.0, in_flight=0), now=41.0)
    after = job(iteration=1)
    memory.observe(after, tick(after, progress=1.0, in_flight=50), now=45.0)
    assert memory.batches_started == 2 and not memory.batch_done
    memory.observe(after, tick(after, progress=0.1), now=47.0)
    memory.observe(after, tick(after, progress=0.6), now=60.0)
    assert memory.batches_started == 2 and memory.batches_ahead(1) == 0
    restored = PaceMemory()
    restored.load(json.loads(json.dumps(memory.to_json())))
    assert restored.to_json() == memory.to_json()
    # The batch after it, seen the usual way, is the third.
    memory.observe(after, tick(after, progress=1.0, in_flight=0), now=80.0)
    later = job(iteration=2)
    memory.observe(later, tick(later, progress=0.05), now=85.0)
    assert memory.batches_started == 3 and memory.batches_ahead(2) == 0


def test_a_rollout_that_generates_ahead_is_recognised_and_half_seen_batches_teach_nothing():
    memory = PaceMemory()
    graph = job()
    memory.observe(graph, tick(graph, progress=0.0), now=1.0)
    memory.observe(graph, tick(graph, progress=0.99), now=101.0)
    # The oldest batch finishes between two ticks; the progress shown is already the next one's.
    memory.observe(graph, tick(graph, progress=0.4), now=102.0)
    assert memory.batches_started == 2
    assert memory.previous_duration_s == pytest.approx(100.0)
    assert memory.batches_ahead(0) == 1
    assert memory.generating_ahead(1)
    memory.observe(graph, tick(graph, progress=1.0, in_flight=0), now=130.0)
    # That batch was joined at 40%: its 29 s are not a batch's duration.
    assert memory.previous_duration_s == pytest.approx(100.0)


def test_tokens_per_iteration_are_learned_from_the_trainer():
    memory = PaceMemory()
    graph = job()
    memory.observe(graph, tick(graph, progress=0.5, trainer_tokens=100.0), now=0.0)
    assert memory.tokens_per_iteration(rollout_view(graph, tick(graph, progress=0.5))) == 0.0
    memory.observe(graph, tick(graph, progress=0.6, trainer_tokens=100.0, rollout_tokens=2000.0), now=10.0)
    # Before a whole iteration: the rollout's decode tokens so far over its progress.
    assert memory.tokens_per_iteration(rollout_view(graph, tick(graph, progress=0.6))) == pytest.approx(
        20_000 / 0.6
    )
    after = job(iteration=1)
    memory.observe(after, tick(after, progress=0.0, trainer_tokens=100.0), now=20.0)
    assert memory.tokens_per_iteration(None) == pytest.approx(100.0 * 10)


def test_the_rollouts_remaining_time_follows_the_previous_batch():
    memory = PaceMemory()
    memory.previous_curve = [100.0 * i / CURVE_POINTS for i in range(CURVE_POINTS + 1)]
    memory.previous_duration_s = 100.0
    memory.batch_started_at = 0.0
    memory.batches_started = 1
    # On the previous batch's pace: 60% done at 60 s leaves its last 40 s.
    assert memory.rollout_remaining_s(view(progress=0.6), 60.0, cap_s=600.0) == pytest.approx(40.0)
    # Twice as slow so far: the estimate stretches (smoothed by the previous duration).
    slower = memory.rollout_remaining_s(view(progress=0.6), 120.0, cap_s=600.0)
    assert 40.0 < slower < 80.0
    assert memory.rollout_remaining_s(view(progress=0.6), 60.0, cap_s=30.0) == 30.0


def test_a_queued_rollout_needs_at_least_its_outstanding_tokens_at_its_rate():
    memory = PaceMemory()
    memory.previous_trained_tokens = 1_000_000.0
    memory.batches_started = 1
    queued = view(progress=0.0, in_flight=500, queue_length=500, tokens_per_s=10_000.0)
    # 1,000 requests of 1,000 tokens (a million tokens over 1,000 episodes) at 10,000 tokens/s.
    remaining = memory.rollout_remaining_s(queued, 10.0, cap_s=600.0, episodes_per_batch=1000)
    assert remaining == pytest.approx(100.0)


def test_without_history_the_tail_is_taken_to_last_as_long_as_the_body():
    memory = PaceMemory()
    memory.batches_started = 1
    assert memory.rollout_remaining_s(view(progress=0.5), 40.0, cap_s=600.0) == pytest.approx(40.0)
    assert memory.rollout_remaining_s(view(progress=0.95), 40.0, cap_s=600.0) == pytest.approx(20.0)
    memory.batch_done = True
    assert memory.rollout_remaining_s(view(progress=1.0, in_flight=0), 40.0, cap_s=600.0) == 0.0


def test_without_history_stragglers_that_outlive_the_tail_rule_are_expected_to_last_as_long_again():
    # Rare outliers: 99% of the batch is done 10 s in, and the last 1% keeps decoding. The
    # light-tail rule alone would expect them done within a tenth of the elapsed time.
    memory = PaceMemory()
    graph = job()
    memory.observe(graph, tick(graph, progress=0.0), now=0.0)
    memory.observe(graph, tick(graph, progress=0.99, in_flight=8), now=10.0)
    stragglers = view(progress=0.99, in_flight=8)
    assert memory.rollout_remaining_s(stragglers, 10.0, cap_s=600.0) == pytest.approx(1.0)
    # 50 s on, still decoding: at least the 50 s they have run since the tail began.
    memory.observe(graph, tick(graph, progress=0.99, in_flight=8), now=60.0)
    assert memory.rollout_remaining_s(stragglers, 60.0, cap_s=600.0) == pytest.approx(50.0)
    assert memory.rollout_remaining_s(stragglers, 60.0, cap_s=30.0) == 30.0


def test_a_rollout_resize_measures_how_much_of_a_step_grows_with_the_batch():
    memory = PaceMemory()
    graph = job(rollout=4)
    before = view(gpus=8, workers=8, in_flight=16, tokens_per_s=1600.0)  # 100 tokens/s a request
    memory.note_rollout_resize(before, 4, now=0.0, settle_s=15.0)
    # Halving the engines made each request 1.3 times slower: 30% of a step grows with the batch.
    signals = {
        "rollout": make_signals(
            graph.node("rollout"),
            in_flight=16,
            tokens_per_s=1600.0 / 1.3,
            progress=0.95,
            utilisation_mean=0.2,
        ),
        "actor": make_signals(graph.node("actor")),
    }
    memory.observe(graph, signals, now=10.0)
    assert memory.kv_share is None  # not settled yet
    memory.observe(graph, signals, now=16.0)
    assert memory.kv_share == pytest.approx(0.3)
    assert memory.probe is None


def test_the_memory_round_trips_through_json():
    memory = PaceMemory()
    graph = job()
    memory.observe(graph, tick(graph, progress=0.0), now=1.0)
    memory.observe(graph, tick(graph, progress=0.7, trainer_tokens=50.0), now=31.0)
    memory.note_rollout_resize(view(), 4, now=31.0, settle_s=10.0)
    again = PaceMemory()
    again.load(json.loads(json.dumps(memory.to_json())))
    assert again.to_json() == memory.to_json()


# -- slowdown and model ------------------------------------------------------------------------


def test_consolidating_stragglers_slows_them_by_the_share_of_a_step_they_grow():
    drained = view(utilisation=0.02, in_flight=16)
    assert kv_read_share(drained) == 0.0  # utilisation under the batch share: no signal
    assert consolidation_slowdown(drained, 4, kv_share_floor=0.3) == pytest.approx(0.7 + 0.3 * 2)
    assert consolidation_slowdown(drained, 8, kv_share_floor=0.3) == pytest.approx(1.0)
    # Queued requests: fewer engines admit proportionally fewer.
    assert consolidation_slowdown(view(queue_length=10), 4) == pytest.approx(2.0)
    # Kept engines that would run above the cap cannot hold the load.
    assert math.isinf(consolidation_slowdown(view(utilisation=0.3), 4, 0.3, max_utilisation=0.4))
    assert math.isinf(consolidation_slowdown(drained, 0))


def test_only_valid_data_parallel_sizes_count_for_a_trainer():
    trainer = make_group("actor", ACTOR, 6, first_device=0, parallelism=Parallelism(valid_dp=(1, 2, 4)))
    assert largest_valid_gpus(trainer, 6) == 4
    assert largest_valid_gpus(trainer, 3) == 2
    assert largest_valid_gpus(trainer, 0) == 0


def model_for(
    graph: Hypergraph, signals: dict[str, GroupSignals], memory: PaceMemory, now: float
) -> PaceModel:
    return PaceModel(
        graph,
        signals,
        linear_profiles({"rollout": 1000.0, "actor": 100.0, "inference": 400.0}),
        memory,
        now,
        n_minibatches=10,
        max_horizon_s=600.0,
        kv_share_prior=0.3,
        max_consolidated_utilisation=0.4,
    )


def test_the_pace_model_trades_the_rollouts_tail_against_the_pipelines_work():
    graph = job()
    memory = PaceMemory()
    memory.batches_started = 1
    memory.previous_trained_tokens = 100_000.0  # 1,000 GPU-seconds of training an iteration
    memory.previous_duration_s = 100.0
    memory.previous_curve = [100.0 * i / CURVE_POINTS for i in range(CURVE_POINTS + 1)]
    signals = tick(graph, progress=0.9, in_flight=8)
    signals["rollout"] = GroupSignals(**{**signals["rollout"].to_json(), "utilisation_mean": 0.05})
    signals["actor"] = make_signals(graph.node("actor"), queue_length=2, in_flight=1, progress=0.2)
    model = model_for(graph, signals, memory, now=90.0)
    base = model.finish_s()
    # The trainer's 800 GPU-seconds on 4 GPUs pace the job (the rollout has ~10 s left).
    assert base == pytest.approx(90.0 + 800.0 / 4)
    more = model.finish_s({"rollout": 4, "actor": 8})
    assert more == pytest.approx(90.0 + 800.0 / 8)
    # A candidate that changes nothing predicts what the base does.
    assert model.finish_s({"rollout": 8, "actor": 4}) == pytest.approx(base)
    # Without a rollout engine left, the batch never ends.
    assert math.isinf(model.finish_s({"rollout": 0, "actor": 12}))
    # Lost GPU-seconds of a move count against the pipeline.
    assert model.finish_s({"rollout": 4, "actor": 8}, lost_gpu_s=80.0) > more


def test_a_waiting_trainer_is_expected_to_reach_its_largest_size_and_idle_groups_do_not_count():
    graph = job(inference=4)
    memory = PaceMemory()
    memory.batches_started = 1
    memory.previous_trained_tokens = 100_000.0
    signals = tick(graph, progress=0.5)
    signals["actor"] = make_signals(graph.node("actor"), busy=False, progress=0.0)
    signals["inference"] = make_signals(graph.node("inference"), queue_length=5, in_flight=4, progress=0.1)
    model = model_for(graph, signals, memory, now=10.0)
    assert model.active == {"inference"}
    # The trainer could take all 16 GPUs but the one worker each of the others must keep.
    assert model.trainer_cap["actor"] == 14
    assert model.finish_s() < math.inf


def test_episodes_waiting_on_tools_do_not_slow_down_when_engines_are_consolidated():
    decoding = view(utilisation=0.02, in_flight=16)
    mostly_in_tools = view(utilisation=0.02, in_flight=16, in_tools=48)
    assert mostly_in_tools.decoding_share == pytest.approx(0.25)
    assert consolidation_slowdown(decoding, 4, kv_share_floor=0.4) == pytest.approx(1.4)
    assert consolidation_slowdown(mostly_in_tools, 4, kv_share_floor=0.4) == pytest.approx(1.1)


def test_the_rollout_view_counts_episodes_in_tool_calls():
    graph = job()
    tool = make_group("tool", ComponentKind.TOOL, 2, first_device=200)
    graph = Hypergraph(job_id=graph.job_id, nodes=(*graph.nodes, tool), edges=graph.edges)
    signals = tick(graph, progress=0.5, in_flight=10)
    signals["tool"] = make_signals(tool, in_flight=30)
    folded = rollout_view(graph, signals)
    assert folded is not None and folded.in_tools == 30 and folded.in_flight == 10


def test_a_group_done_with_its_share_of_the_iteration_may_give_up_every_gpu():
    graph = job(inference=4)
    memory = PaceMemory()
    memory.batches_started = 1
    memory.previous_trained_tokens = 100_000.0
    memory.batch_done = True  # the rollout's batch is finished
    signals = tick(graph, progress=1.0, in_flight=0)
    signals["inference"] = make_signals(graph.node("inference"), busy=False, progress=1.0)
    signals["actor"] = make_signals(graph.node("actor"), queue_length=2, in_flight=1, progress=0.5)
    model = model_for(graph, signals, memory, now=100.0)
    base = model.finish_s()
    # 500 GPU-seconds of training left on 4 GPUs; on 16 when both finished groups give theirs.
    assert base == pytest.approx(100.0 + 500.0 / 4)
    assert model.finish_s({"rollout": 0, "inference": 0, "actor": 16}) == pytest.approx(100.0 + 500.0 / 16)
    # A log-prob group with work left cannot.
    signals["inference"] = make_signals(graph.node("inference"), queue_length=3, in_flight=4, progress=0.5)
    model = model_for(graph, signals, memory, now=100.0)
    assert math.isinf(model.finish_s({"inference": 0, "actor": 8}))


def test_once_the_rollout_is_done_a_synchronous_trainer_inherits_the_upstream_gpus():
    # The rollout's batch is over; the log-prob group has 200 GPU-seconds queued on 4 GPUs and
    # the trainer 500 on 4. When the log-prob group is done, its GPUs and the rollout's join the
    # trainer, up to its largest valid size, so GPUs that finish the log-probs sooner bring
    # that forward.
    graph = job(inference=4)
    memory = PaceMemory()
    memory.batches_started = 1
    memory.previous_trained_tokens = 100_000.0
    memory.batch_done = True
    signals = tick(graph, progress=1.0, in_flight=0)
    signals["inference"] = make_signals(graph.node("inference"), queue_length=3, in_flight=4, progress=0.5)
    signals["actor"] = make_signals(graph.node("actor"), queue_length=2, in_flight=1, progress=0.5)
    model = model_for(graph, signals, memory, now=100.0)
    assert model.trainer_inherits
    reach = model.trainer_cap["actor"]
    assert reach > 4
    upstream = 50_000.0 / 400.0  # the log-prob group's remaining GPU-seconds
    # No sooner, either, than all the pipeline's work on the GPUs that have work now.
    inherited = upstream / 4 + (500.0 - 4 * upstream / 4) / reach
    assert model.finish_s() == pytest.approx(100.0 + max(inherited, (upstream + 500.0) / 8))
    # The idle rollout's GPUs to the log-prob group: it is done in half the time, the trainer
    # inherits sooner. At its size now the trainer would have seen no gain at all.
    sooner = model.finish_s({"rollout": 0, "inference": 12})
    inherited = upstream / 12 + (500.0 - 4 * upstream / 12) / reach
    assert sooner == pytest.approx(100.0 + max(inherited, (upstream + 500.0) / 16))
    assert sooner < model.finish_s() - 10.0

    # While the rollout still generates, its end is an estimate: the trainer keeps its size.
    generating = tick(graph, progress=0.9, in_flight=8)
    generating["inference"] = signals["inference"]
    generating["actor"] = signals["actor"]
    memory.batch_done = False
    assert not model_for(graph, generating, memory, now=100.0).trainer_inherits
    # Nor does it inherit when the rollout generates ahead (asynchronous RL): the rollout needs
    # its GPUs for the next batch.
    memory.batch_done = True
    memory.batches_started = 2
    assert not model_for(graph, signals, memory, now=100.0).trainer_inherits


def test_gpus_a_waiting_pipeline_lends_a_synchronous_rollout_cost_it_nothing_until_the_batch_is_in():
    # 10 s into a batch of a synchronous iteration: the rollout has requests waiting for a slot
    # and ~90 s to go; the log-prob group (4 GPUs) and the trainer (4) have nothing yet and
    # 1,250 GPU-seconds between them once the samples come. Their GPUs can only work on what
    # has arrived, and the rollout's 8 join them once it is done: the pipeline's work is done
    # no sooner than on 8 GPUs for 90 s and all 16 after.
    graph = job(inference=4)
    memory = PaceMemory()
    memory.batches_started = 1
    memory.previous_trained_tokens = 100_000.0
    memory.previous_duration_s = 100.0
    memory.previous_curve = [100.0 * i / CURVE_POINTS for i in range(CURVE_POINTS + 1)]
    signals = tick(graph, progress=0.1, in_flight=400, queue=100)
    signals["inference"] = make_signals(graph.node("inference"), busy=False, progress=0.0)
    signals["actor"] = make_signals(graph.node("actor"), busy=False, progress=0.0)
    model = model_for(graph, signals, memory, now=10.0)
    assert not model.active and model.rollout_s == pytest.approx(90.0)
    base = model.finish_s()
    assert base == pytest.approx(10.0 + 90.0 + (1250.0 - 8 * 90.0) / 16)
    # Two log-prob GPUs lent to the rollout shorten it by a fifth: the pipeline loses nothing.
    # (Taken to work on 6 GPUs from now on, the 1,250 GPU-seconds would have cost 42 s.)
    assert model.finish_s({"inference": 2, "rollout": 10}) <= base + 1e-9
    # A rollout generating ahead (asynchronous RL) keeps its GPUs for the next batch: there the
    # pipeline's GPUs are all it has.
    memory.batches_started = 2
    ahead = model_for(graph, signals, memory, now=10.0)
    assert ahead.finish_s({"inference": 2, "rollout": 10}) > ahead.finish_s()


def test_an_empty_rollout_teaches_the_memory_nothing():
    memory = PaceMemory()
    graph = job()
    memory.observe(graph, tick(graph, progress=0.0), now=1.0)
    memory.observe(graph, tick(graph, progress=1.0, in_flight=0), now=41.0)
    assert memory.batch_done and memory.batches_started == 1
    # Every engine lent out: the group reports no progress, which is not a new batch.
    empty = make_graph(
        make_group("rollout", ROLLOUT, 0, first_device=0), make_group("actor", ACTOR, 12, first_device=50)
    )
    memory.observe(empty, tick(empty, progress=0.0, in_flight=0), now=45.0)
    assert memory.batch_done and memory.batches_started == 1
    assert not memory.generating_ahead(1)
