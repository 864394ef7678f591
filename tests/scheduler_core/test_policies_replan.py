"""dynarl's re-planning and its no-harm rule: the iteration ledger, the placement choice from
what the job measured, the re-planned base split, and the per-kind record of moves."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Reason
from scheduler.core.hypergraph import ComponentKind, Hypergraph, Parallelism
from scheduler.core.policies import Placement
from scheduler.core.policies.moves import migration_cost_s
from scheduler.core.policies.outcomes import MIN_OUTCOMES, MoveOutcomes, OpenOutcome
from scheduler.core.policies.replan import (
    TRIAL_MARGIN_PRIOR,
    IterationLedger,
    IterationRecord,
    PlacementModel,
    Replanner,
    measured_record,
    time_shared,
)
from scheduler.core.policies.serial import SerialDriver
from scheduler.core.signals import GroupSignals, MeasuredIteration
from scheduler.core.sim.families import LengthFamily, reshape
from scheduler.core.sim.runner import simulate
from scheduler.core.sim.simulator import SimOptions
from scheduler.core.sim.trace import TraceRecord, generate_trace
from scheduler.core.sim.workloads import get_workload
from tests.scheduler_core.test_policies_dynarl import drained, job, policy_with
from tests.scheduler_core.test_policies_fixtures import make_graph, make_group, make_signals

ROLLOUT = ComponentKind.ROLLOUT
ACTOR = ComponentKind.ACTOR
COST = MigrationCostModel(model_params_b=7.0)


def record(placement: Placement, duration_s: float, **fields: Any) -> IterationRecord:
    values: dict[str, Any] = {
        "iteration": 0,
        "placement": placement,
        "duration_s": duration_s,
        "total_gpus": 64,
        "rollout_body_s": 20.0,
        "rollout_body_gpu_s": 20.0 * 48,
        "rollout_tail_s": 0.0,
        "rollout_tail_gpu_s": 0.0,
        "pipeline_gpu_s": 2800.0,
        "pipeline_overlap_gpu_s": 100.0,
        "tokens": 1e6,
    }
    values.update(fields)
    return IterationRecord(**values)


def with_tail(
    placement: Placement,
    duration_s: float,
    *,
    body_s: float,
    gpus: int,
    tail_s: float,
    tail_gpus: int,
    iteration: int = 0,
) -> IterationRecord:
    """A long-tailed iteration: the rollout's body on ``gpus``, its tail on ``tail_gpus``."""
    return record(
        placement,
        duration_s,
        iteration=iteration,
        rollout_body_s=body_s,
        rollout_body_gpu_s=body_s * gpus,
        rollout_tail_s=tail_s,
        rollout_tail_gpu_s=tail_s * tail_gpus,
        pipeline_gpu_s=7000.0,
    )


def replanner() -> Replanner:
    return Replanner(PlacementModel(COST, n_minibatches=8), margin=0.1)


# -- the ledger ------------------------------------------------------------------------------


def tick(ledger: IterationLedger, now: float, *, idle: int, in_flight: int, actor_utilisation: float) -> None:
    rollout = make_group("rollout", ROLLOUT, 4, first_device=0)
    actor = make_group("actor", ACTOR, 2, first_device=10)
    graph = make_graph(rollout, actor)
    signals: dict[str, GroupSignals] = {
        "rollout": make_signals(rollout, idle=idle, in_flight=in_flight),
        "actor": make_signals(actor, utilisation_mean=actor_utilisation, tokens_per_s=100.0),
    }
    ledger.observe(graph, signals, now)


def test_the_ledger_splits_the_rollout_into_body_and_tail_and_integrates_the_pipeline() -> None:
    ledger = IterationLedger(low_fraction_threshold=0.5)
    tick(ledger, 0.0, idle=0, in_flight=40, actor_utilisation=0.0)  # starts the iteration
    for t in (1.0, 2.0, 3.0):  # body: every engine busy
        tick(ledger, t, idle=0, in_flight=40, actor_utilisation=0.5)
    for t in (4.0, 5.0):  # tail: three of four engines drained
        tick(ledger, t, idle=3, in_flight=2, actor_utilisation=1.0)
    tick(ledger, 6.0, idle=4, in_flight=0, actor_utilisation=1.0)  # the rollout is done
    closed = ledger.close(6.0, total_gpus=6, placement=Placement.DISAGGREGATED)
    assert closed is not None
    assert (closed.rollout_body_s, closed.rollout_tail_s) == (3.0, 2.0)
    assert closed.rollout_body_gpu_s == 12.0 and closed.tail_gpus == 4.0
    assert closed.pipeline_gpu_s == 2 * (3 * 0.5 + 3 * 1.0)
    assert closed.pipeline_overlap_gpu_s == 2 * (3 * 0.5 + 2 * 1.0)
    assert closed.tokens == 600.0 and closed.duration_s == 6.0
    assert closed.tail_share == 0.4


def test_the_ledger_times_the_rollout_saturated_while_requests_wait_or_its_engines_run_full() -> None:
    rollout = make_group("rollout", ROLLOUT, 4, first_device=0)
    graph = make_graph(rollout, make_group("actor", ACTOR, 2, first_device=10))
    ledger = IterationLedger(low_fraction_threshold=0.5)

    def at(now: float, **fields: Any) -> None:
        ledger.observe(graph, {"rollout": make_signals(rollout, in_flight=40, **fields)}, now)

    at(0.0, utilisation_mean=1.0)  # starts the iteration
    at(1.0, utilisation_mean=0.95)  # every engine (nearly) full
    at(2.0, utilisation_mean=0.6, queue_length=12)  # retracted requests wait for a slot
    at(3.0, utilisation_mean=0.6)  # engines part full, nothing waiting: paced by its requests
    at(4.0, utilisation_mean=0.3)
    assert ledger.sums["rollout_body_s"] == 4.0
    assert (ledger.sums["rollout_saturated_s"], ledger.sums["rollout_saturated_gpu_s"]) == (2.0, 8.0)


def test_the_ledger_reads_decode_steps_where_the_load_held_for_a_window_and_the_share_that_grew() -> None:
    # Every sequence in flight gains a token a step, so a step takes in_flight / tokens_per_s.
    # The rate is a window's average: a step is read only once the count in flight held for a
    # whole window. The shortest step read bounds the part of a step that does not grow with
    # the sequences, so a longer step at the same load grew by at least the difference.
    rollout = make_group("rollout", ROLLOUT, 4, first_device=0)
    graph = make_graph(rollout, make_group("actor", ACTOR, 2, first_device=10))

    def at(ledger: IterationLedger, now: float, in_flight: int, tokens_per_s: float) -> None:
        signals = make_signals(
            rollout, in_flight=in_flight, tokens_per_s=tokens_per_s, utilisation_mean=0.6, window_s=2.0
        )
        ledger.observe(graph, {"rollout": signals}, now)

    ledger = IterationLedger(low_fraction_threshold=0.5)
    at(ledger, 0.0, 400, 100_000.0)  # starts the iteration
    at(ledger, 1.0, 400, 100_000.0)  # the load is steady since this tick...
    at(ledger, 2.0, 400, 100_000.0)  # ...for one second of the two-second window: no step read yet
    assert ledger.step_floor_s is None and ledger.sums["rollout_paced_sequence_s"] == 0.0
    at(ledger, 3.0, 400, 100_000.0)  # a whole window: 4 ms steps, the shortest so far
    assert ledger.step_floor_s == 400 / 100_000.0
    assert ledger.sums["rollout_paced_sequence_s"] == 0.0  # nothing grew yet
    at(ledger, 4.0, 396, 50_000.0)  # contexts grew: 7.9 ms steps, at least half of it the sequences'
    grew = 1.0 - (400 / 100_000.0) / (396 / 50_000.0)
    assert ledger.sums["rollout_paced_sequence_s"] == grew
    at(ledger, 5.0, 200, 60_000.0)  # half the sequences done within the window: its rate says nothing
    assert ledger.sums["rollout_paced_sequence_s"] == grew
    assert ledger.step_floor_s == 400 / 100_000.0
    assert (ledger.sums["rollout_paced_s"], ledger.sums["rollout_paced_gpu_s"]) == (5.0, 20.0)
    assert ledger.sums["rollout_saturated_s"] == 0.0

    # The live tick builds the policy anew each tick from the job's saved state: a ledger
    # reloaded before every tick reads the same steps.
    reloaded = IterationLedger(low_fraction_threshold=0.5)
    for now, in_flight, rate in (
        (0.0, 400, 1e5),
        (1.0, 400, 1e5),
        (2.0, 400, 1e5),
        (3.0, 400, 1e5),
        (4.0, 396, 5e4),
    ):
        fresh = IterationLedger(low_fraction_threshold=0.5)
        fresh.load(reloaded.to_json())
        reloaded = fresh
        at(reloaded, now, in_flight, rate)
    assert reloaded.sums["rollout_paced_sequence_s"] == grew
    assert reloaded.step_floor_s == 400 / 100_000.0


def test_a_request_paced_rollout_is_predicted_shorter_colocated_by_the_share_of_its_steps_that_grew() -> None:
    # 300 s of a rollout paced by its requests on 48 GPUs. Colocated, its sequences spread over
    # 64 engines: each step's part that grew with the sequences an engine held shrinks to 48/64,
    # the rest (the weights read once a step) stays. Measured without that share, it stays as long.
    model = PlacementModel(COST, n_minibatches=8)
    paced = record(
        Placement.DISAGGREGATED,
        470.0,
        rollout_body_s=300.0,
        rollout_body_gpu_s=300.0 * 48,
        pipeline_gpu_s=10_000.0,
        rollout_paced_s=300.0,
        rollout_paced_gpu_s=300.0 * 48,
    )
    rest = 10_000.0 / 64 + model.stage_switches_s(64)
    assert model.colocated_s(paced) == 300.0 + rest
    half = replace(paced, rollout_paced_sequence_s=150.0)
    assert model.colocated_s(half) == 300.0 * (0.5 + 0.5 * 48 / 64) + rest
    # Part of the body paced, part saturated: each part spreads as it ran.
    mixed = replace(
        half, rollout_paced_s=200.0, rollout_paced_gpu_s=200.0 * 48, rollout_paced_sequence_s=100.0
    )
    mixed = replace(mixed, rollout_saturated_s=100.0, rollout_saturated_gpu_s=100.0 * 48)
    assert model.colocated_s(mixed) == 200.0 * (0.5 + 0.5 * 48 / 64) + 100.0 * 48 / 64 + rest


def test_a_rollout_that_generates_its_batch_between_two_ticks_is_charged_the_interval_once() -> None:
    rollout = make_group("rollout", ROLLOUT, 4, first_device=0)
    actor = make_group("actor", ACTOR, 2, first_device=10)

    def at(ledger: IterationLedger, now: float, *, progress: float, in_flight: int = 0) -> None:
        signals = {
            "rollout": make_signals(
                rollout, idle=0 if in_flight else 4, in_flight=in_flight, progress=progress
            ),
            "actor": make_signals(actor, utilisation_mean=1.0),
        }
        iteration = ledger.iteration if ledger.iteration is not None else 0
        ledger.observe(make_graph(rollout, actor, iteration=iteration), signals, now)

    # Short answers on many engines: the first tick already finds the batch generated.
    ledger = IterationLedger(low_fraction_threshold=0.5)
    at(ledger, 0.0, progress=1.0)  # the iteration's first tick
    for now in (1.0, 2.0, 3.0):
        at(ledger, now, progress=1.0)
    closed = ledger.close(3.0, total_gpus=6, placement=Placement.DISAGGREGATED)
    assert closed is not None, "an iteration whose rollout no tick saw generating is still measured"
    assert (closed.rollout_body_s, closed.rollout_body_gpu_s, closed.rollout_tail_s) == (1.0, 4.0, 0.0)
    assert closed.idle_s == 0.0 and closed.pipeline_overlap_gpu_s == 2.0

    # Waiting for its GPUs at first (nothing generating, not done), then done between two ticks.
    ledger.start(1, 10.0)
    at(ledger, 11.0, progress=0.0)
    at(ledger, 12.0, progress=0.0)
    at(ledger, 13.0, progress=1.0)
    at(ledger, 14.0, progress=1.0)
    assert ledger.sums["rollout_body_s"] == 1.0

    # Seen generating: charged as it is seen, never again once it is done.
    ledger.start(2, 20.0)
    at(ledger, 21.0, progress=0.5, in_flight=40)
    at(ledger, 22.0, progress=0.9, in_flight=4)
    at(ledger, 23.0, progress=1.0)
    at(ledger, 24.0, progress=1.0)
    assert ledger.sums["rollout_body_s"] + ledger.sums["rollout_tail_s"] == 2.0

    # What the ledger owes survives the policy's state being saved and loaded between ticks.
    ledger.start(3, 30.0)
    reloaded = IterationLedger(low_fraction_threshold=0.5)
    reloaded.load(ledger.to_json())
    at(reloaded, 31.0, progress=1.0)
    assert reloaded.sums["rollout_body_s"] == 1.0


def test_a_ledger_that_saw_too_little_of_an_iteration_records_nothing() -> None:
    ledger = IterationLedger(low_fraction_threshold=0.5)
    tick(ledger, 0.0, idle=0, in_flight=40, actor_utilisation=0.0)
    tick(ledger, 1.0, idle=0, in_flight=40, actor_utilisation=0.0)
    assert ledger.close(2.0, total_gpus=6, placement=Placement.DISAGGREGATED) is None
    # A gap (a restarted scheduler) is charged to nobody.
    tick(ledger, 500.0, idle=0, in_flight=40, actor_utilisation=0.0)
    assert ledger.sums["rollout_body_s"] == 1.0


def test_the_ledger_counts_the_boundary_as_idle_and_not_a_re_placement_at_all() -> None:
    ledger = IterationLedger(low_fraction_threshold=0.5, u_low=0.2)
    tick(ledger, 0.0, idle=0, in_flight=40, actor_utilisation=0.0)
    for t in (1.0, 2.0, 3.0):  # generating: never idle, whatever the trainer does
        tick(ledger, t, idle=0, in_flight=40, actor_utilisation=0.0)
    tick(ledger, 4.0, idle=4, in_flight=0, actor_utilisation=0.9)  # training
    for t in (5.0, 6.0):  # the boundary: nothing generating, the trainer done
        tick(ledger, t, idle=4, in_flight=0, actor_utilisation=0.1)
    assert ledger.sums["idle_s"] == 2.0
    # The job is laid out anew at the boundary: the 40 s until the next tick in the new layout
    # are the switch's, and the iteration's clock starts there.
    ledger.hold()
    tick(ledger, 46.0, idle=0, in_flight=40, actor_utilisation=0.0)
    assert ledger.take_switch_s() == 40.0 and ledger.take_switch_s() is None
    for t in (47.0, 48.0, 49.0):
        tick(ledger, t, idle=0, in_flight=40, actor_utilisation=0.0)
    closed = ledger.close(49.0, total_gpus=6, placement=Placement.COLOCATED)
    assert closed is not None and closed.duration_s == 3.0 and closed.rollout_body_s == 6.0


def test_a_job_is_time_shared_when_every_gpu_group_sits_on_the_widest_ones_devices() -> None:
    everywhere = make_graph(
        make_group("rollout", ROLLOUT, 8, first_device=0), make_group("actor", ACTOR, 8, first_device=0)
    )
    fewer = make_graph(
        make_group("rollout", ROLLOUT, 8, first_device=0), make_group("actor", ACTOR, 6, first_device=2)
    )
    apart = make_graph(
        make_group("rollout", ROLLOUT, 6, first_device=0), make_group("actor", ACTOR, 2, first_device=6)
    )
    # Log-probs sharing the trainer's two GPUs while the rollout has its own: only partly shared.
    partly = make_graph(
        make_group("rollout", ROLLOUT, 6, first_device=0),
        make_group("ref", ComponentKind.INFERENCE, 2, first_device=6),
        make_group("actor", ACTOR, 2, first_device=6),
    )
    assert time_shared(everywhere) and time_shared(fewer)
    assert not time_shared(apart) and not time_shared(partly)


# -- the placement choice ---------------------------------------------------------------------


def test_a_placement_never_run_must_beat_the_models_error_and_a_missed_trial_raises_it() -> None:
    plan = replanner()
    no_tail = record(Placement.DISAGGREGATED, 95.0)
    plan.learn(no_tail)
    choice = plan.choose(Placement.DISAGGREGATED, 48, 2, allow_colocated=True)
    assert choice is not None and choice.placement is Placement.COLOCATED
    assert "modelled" in choice.detail and f"needs {TRIAL_MARGIN_PRIOR:.0%}" in choice.detail
    predicted = choice.predicted_s[Placement.COLOCATED]
    # The trial took twice what was predicted: the next crossing into colocated needs that much.
    plan.learn(record(Placement.COLOCATED, 2 * predicted, iteration=1))
    assert plan.trial_margin(Placement.COLOCATED) == 0.5
    # Colocated was measured slower than disaggregated: the job goes back on the measurement.
    back = plan.choose(Placement.COLOCATED, 48, 64, allow_colocated=True)
    assert back is not None and back.placement is Placement.DISAGGREGATED
    assert "measured throughput" in back.detail


def test_a_switch_is_made_when_a_few_iterations_of_saving_pay_for_it_and_not_sooner() -> None:
    # A short iteration (a 2 s rollout body, 64 GPU-s of pipeline), where the switch's engine
    # starts and state spread weigh as much as the saving.
    short: dict[str, Any] = {
        "rollout_body_s": 2.0,
        "rollout_body_gpu_s": 96.0,
        "pipeline_gpu_s": 64.0,
        "pipeline_overlap_gpu_s": 0.0,
    }
    model = PlacementModel(COST, n_minibatches=8)
    colocated = model.colocated_s(record(Placement.DISAGGREGATED, 10.0, **short))
    switch = model.switch_s(Placement.COLOCATED, 64, 2)
    for saving, switches in ((switch / 3 + 0.2, True), (switch / 3 - 0.2, False)):
        plan = replanner()
        plan.learn(record(Placement.DISAGGREGATED, colocated + saving, **short))
        choice = plan.choose(Placement.DISAGGREGATED, 48, 2, allow_colocated=True)
        assert saving > TRIAL_MARGIN_PRIOR * (colocated + saving) and saving < switch
        # Three iterations of saving pay for the switch: it is made; less, it is not.
        assert choice is not None and (choice.placement is Placement.COLOCATED) is switches, choice.detail


def test_staying_disaggregated_is_charged_the_homecoming_of_the_gpus_lent_within_the_iteration() -> None:
    # The first iteration lent its drained GPUs to the pipeline; colocated is predicted 8% faster
    # than it took, short of the 10% a placement never run must beat. Staying, the next iteration
    # opens by bringing those GPUs home; a switch rebuilds the placement instead.
    first = record(Placement.DISAGGREGATED, 0.0)
    duration = PlacementModel(COST, n_minibatches=8).colocated_s(first) / 0.92
    first = replace(first, duration_s=duration)
    opening = 0.05 * duration
    plan = replanner()
    plan.learn(first)
    kept = plan.choose(Placement.DISAGGREGATED, 48, 64, allow_colocated=True)
    assert kept is not None and kept.placement is Placement.DISAGGREGATED, kept.detail
    plan = replanner()
    plan.learn(first)
    switched = plan.choose(Placement.DISAGGREGATED, 48, 64, allow_colocated=True, opening_s=opening)
    assert switched is not None and switched.placement is Placement.COLOCATED, switched.detail
    assert switched.predicted_s[Placement.DISAGGREGATED] == duration + opening
    assert "to bring its lent GPUs home" in switched.detail
    assert plan.opening_s == 0.0
    # A job that stays pays the opening in its next iteration's duration, which is not charged it
    # twice, also by a scheduler restarted from the saved state in between.
    held = replanner()
    held.learn(first)
    held.choose(Placement.DISAGGREGATED, 48, 64, allow_colocated=False, opening_s=opening)
    held.learn(replace(first, iteration=1, duration_s=duration + opening))
    restarted = replanner()
    restarted.load(held.to_json())
    for plan in (held, restarted):
        again = plan.choose(Placement.DISAGGREGATED, 48, 64, allow_colocated=False, opening_s=opening)
        assert again is not None and again.predicted_s[Placement.DISAGGREGATED] == duration + opening


def test_the_homecoming_is_the_slowest_return_in_the_share_of_the_rollouts_gpus_away() -> None:
    policy = policy_with()
    rollout = make_group("rollout", ROLLOUT, 4, first_device=0)
    actor = make_group("actor", ACTOR, 8, first_device=50, depends_on=("rollout",))
    graph = make_graph(rollout, actor)
    assert policy._opening_s(graph) == 0.0
    # Half its GPUs are with the trainer: the rollout's body runs on the other half while they
    # come home.
    policy.loans.lend("rollout", "actor", ["n0-g54", "n0-g55", "n0-g56", "n0-g57"], 1.0)
    back = migration_cost_s(policy.cost_model, actor, rollout, 4)
    assert policy._opening_s(graph) == 0.5 * back
    # A loan from another group delays nothing the rollout does.
    policy.loans.lend("inference", "actor", ["n0-g58"], 1.0)
    assert policy._opening_s(graph) == 0.5 * back


def test_a_saturated_rollout_is_predicted_to_spread_over_every_gpu_when_colocated() -> None:
    # Every response near max_new_tokens: the rollout's 300 s on 48 GPUs were bound by how many
    # sequences its engines hold (full, then retracting), not by one request's decode, so 64
    # engines would take it on sooner; a rollout paced by its requests keeps its length.
    model = PlacementModel(COST, n_minibatches=8)
    long: dict[str, Any] = {
        "rollout_body_s": 300.0,
        "rollout_body_gpu_s": 300.0 * 48,
        "pipeline_gpu_s": 10_000.0,
    }
    paced = record(Placement.DISAGGREGATED, 470.0, **long)
    saturated = replace(paced, rollout_saturated_s=300.0, rollout_saturated_gpu_s=300.0 * 48)
    switches = model.stage_switches_s(64)
    assert model.colocated_s(paced) == 300.0 + 10_000.0 / 64 + switches
    assert model.colocated_s(saturated) == 300.0 * 48 / 64 + 10_000.0 / 64 + switches
    half = replace(paced, rollout_saturated_s=150.0, rollout_saturated_gpu_s=150.0 * 48)
    assert model.colocated_s(half) == 150.0 + 150.0 * 48 / 64 + 10_000.0 / 64 + switches
    for measured, placement in ((paced, Placement.DISAGGREGATED), (saturated, Placement.COLOCATED)):
        plan = replanner()
        plan.learn(measured)
        choice = plan.choose(Placement.DISAGGREGATED, 48, 2, allow_colocated=True)
        assert choice is not None and choice.placement is placement, choice.detail


def test_an_iteration_that_is_mostly_its_boundary_is_not_switched_for_its_short_rollout() -> None:
    # A small real job: 8 GPUs, a 2 s rollout body on 5 of them, little trainer work, and 4 s of
    # the 6 s iteration spent at the boundary (weights pushed, results reported). More engines
    # shorten only the rollout's body; the boundary stays what it was.
    small: dict[str, Any] = {
        "total_gpus": 8,
        "rollout_body_s": 2.0,
        "rollout_body_gpu_s": 10.0,
        "pipeline_gpu_s": 0.5,
        "pipeline_overlap_gpu_s": 0.0,
        "tokens": 0.0,
    }
    model = PlacementModel(COST, n_minibatches=8)
    busy = record(Placement.DISAGGREGATED, 6.0, **small)
    at_boundary = record(Placement.DISAGGREGATED, 6.0, idle_s=4.0, **small)
    assert model.colocated_s(at_boundary) == model.colocated_s(busy) + 4.0
    assert model.disaggregated_s(at_boundary, 5) == model.disaggregated_s(busy, 5) + 4.0
    plan = replanner()
    plan.learn(at_boundary)
    choice = plan.choose(Placement.DISAGGREGATED, 5, 1, allow_colocated=True)
    assert choice is not None and choice.placement is Placement.DISAGGREGATED, choice.detail


def test_placements_measured_without_trainer_throughput_are_compared_by_their_durations() -> None:
    plan = replanner()
    plan.learn(record(Placement.DISAGGREGATED, 60.0, tokens=0.0))
    plan.learn(record(Placement.COLOCATED, 90.0, tokens=0.0, iteration=1))
    back = plan.choose(Placement.COLOCATED, 48, 64, allow_colocated=True)
    assert back is not None and back.placement is Placement.DISAGGREGATED
    assert back.predicted_s[Placement.DISAGGREGATED] == 60.0 and "measured throughput" in back.detail


def test_a_switch_measured_slow_on_this_job_is_priced_as_measured() -> None:
    no_tail = record(Placement.DISAGGREGATED, 95.0)
    plan = replanner()
    plan.learn(no_tail)
    before = plan.choose(Placement.DISAGGREGATED, 48, 2, allow_colocated=True)
    assert before is not None and before.placement is Placement.COLOCATED
    saving = before.predicted_s[Placement.DISAGGREGATED] - before.predicted_s[Placement.COLOCATED]
    # Workers that take minutes to start: three iterations of that saving no longer pay it back.
    plan.learn_switch(4 * saving)
    plan.learn_switch(1.0)  # a quicker one later does not make the next look cheap
    after = plan.choose(Placement.DISAGGREGATED, 48, 2, allow_colocated=True)
    assert after is not None and after.placement is Placement.DISAGGREGATED
    assert "as measured on this job" in after.detail and "does not pay" in after.detail


def test_a_slow_control_plane_makes_switches_dearer_but_not_the_stage_swaps_inside_the_job() -> None:
    slow = replace(COST, measured_scale=4.0)
    base, scaled = PlacementModel(COST, n_minibatches=8), PlacementModel(slow, n_minibatches=8)
    last = record(Placement.DISAGGREGATED, 95.0)
    assert scaled.colocated_s(last) == base.colocated_s(last)
    assert scaled.switch_s(Placement.COLOCATED, 64, 2) == 4.0 * base.switch_s(Placement.COLOCATED, 64, 2)


def test_a_long_tail_keeps_the_job_disaggregated_and_an_asynchronous_one_never_colocates() -> None:
    plan = replanner()
    plan.learn(with_tail(Placement.DISAGGREGATED, 230.0, body_s=120.0, gpus=48, tail_s=80.0, tail_gpus=8))
    choice = plan.choose(Placement.DISAGGREGATED, 48, 2, allow_colocated=True)
    assert choice is not None and choice.placement is Placement.DISAGGREGATED
    plan.learn(record(Placement.DISAGGREGATED, 95.0))
    held = plan.choose(Placement.DISAGGREGATED, 48, 2, allow_colocated=False)
    assert held is not None and held.placement is Placement.DISAGGREGATED
    assert "generates ahead" in held.detail


def test_a_measurement_of_the_other_placement_goes_stale_when_the_tail_changes() -> None:
    plan = replanner()
    plan.learn(record(Placement.DISAGGREGATED, 95.0))
    plan.learn(record(Placement.COLOCATED, 63.0, iteration=1))
    stay = plan.choose(Placement.COLOCATED, 48, 64, allow_colocated=True)
    assert stay is not None and stay.placement is Placement.COLOCATED
    assert "measured throughput" in stay.detail
    # The tail comes back: the colocated iteration's rollout is now mostly tail.
    plan.learn(
        with_tail(Placement.COLOCATED, 275.0, body_s=73.0, gpus=64, tail_s=85.0, tail_gpus=64, iteration=2)
    )
    back = plan.choose(Placement.COLOCATED, 48, 64, allow_colocated=True)
    assert back is not None and back.placement is Placement.DISAGGREGATED
    assert "modelled" in back.detail


def reshaped(name: str, families: str, iterations: int) -> list[TraceRecord]:
    """The generator's episodes of workload ``name``, each iteration's lengths from
    ``families`` (``L`` lognormal, as generated; ``U`` uniform, no tail)."""
    workload = get_workload(name)
    base = generate_trace(workload, 0, iterations=iterations)
    uniform = reshape(base, workload, LengthFamily.UNIFORM, 0)
    per = workload.episodes_per_iteration
    records: list[TraceRecord] = []
    for i, family in enumerate(families):
        source = base if family == "L" else uniform
        records.extend(source[i * per : (i + 1) * per])
    return records


def test_a_job_whose_tail_disappears_converges_to_colocated_and_goes_back_when_it_returns() -> None:
    # On math-1.5B-64 a no-tail iteration takes about 28 s disaggregated and 20 s colocated.
    workload = replace(get_workload("math-1.5B-64"), iterations=8)
    records = reshaped(workload.name, "LLUUUULL", 8)
    result = simulate(workload, "dynarl", records=records, options=SimOptions(iterations=8))
    placements = "".join(p[0].upper() for p in result.placements)
    # Long tails keep it disaggregated; within two iterations of the tail vanishing it
    # time-shares every GPU, and within two of the tail returning it is disaggregated again.
    assert placements[:2] == "DD"
    assert placements[4:6] == "CC"
    assert placements[-1] == "D"
    first, back = result.placement_changes
    assert (first.to, back.to) == ("colocated", "disaggregated")
    assert "tail 0.0s" in first.why and "saves" in first.why
    assert back.iteration >= 6


def test_a_job_spec_that_stays_disaggregated_when_replanning_is_off() -> None:
    workload = replace(get_workload("math-7B-64"), iterations=3)
    result = simulate(
        workload,
        "dynarl",
        records=reshaped("math-7B-64", "UUU", 3),
        params={"replan": False},
        options=SimOptions(iterations=3),
    )
    assert result.placements == ("disaggregated",) * 3 and not result.placement_changes


def test_a_split_that_gave_log_probs_more_gpus_than_their_work_is_re_planned_from_gpus_coming_home() -> None:
    # agentic-7B-64's planned split gives the log-prob group 28 GPUs it keeps busy a third of the
    # iteration, while its multi-turn rollout is paced by 34 engines. At the first boundary every
    # GPU is on loan to the trainer: part of the log-prob group's return goes to the rollout
    # instead, and the log-prob group keeps what its measured work needed.
    workload = replace(get_workload("agentic-7B-64"), iterations=3)
    records = generate_trace(workload, 0, iterations=3)
    result = simulate(workload, "dynarl", records=records, options=SimOptions(iterations=3))
    [rebased] = [m for m in result.moves if m.reason == Reason.REPLAN_BASE_SPLIT.value]
    assert (rebased.donor, rebased.recipient, rebased.iteration) == ("actor", "rollout", 1)
    home = [m for m in result.moves if m.reason == Reason.RETURN_BORROWED.value and m.iteration == 1]
    to_log_probs = sum(m.gpus for m in home if m.recipient == "inference")
    assert to_log_probs + rebased.gpus == result.initial_split["inference"]
    assert to_log_probs >= 8  # ~1,450 busy GPU-seconds over a rollout of about 140 s
    static = simulate(
        workload, "dynarl", records=records, params={"replan": False}, options=SimOptions(iterations=3)
    )
    assert not [m for m in static.moves if m.reason == Reason.REPLAN_BASE_SPLIT.value]
    # The iterations after it run faster than on the split as planned.
    assert (
        result.iteration_end_s[-1] - result.iteration_end_s[0]
        < static.iteration_end_s[-1] - static.iteration_end_s[0]
    )


def test_a_shift_to_the_rollout_that_costs_nothing_if_the_rollout_gains_nothing_needs_only_the_noise_margin() -> (
    None
):
    # agentic-7B-64 with later turns longer: the log-prob group's 16 GPUs are busy under half the
    # iteration, and 8 of them to the rollout are predicted about 9% faster, under the 10% that
    # covers the model's error. With the 8 it keeps, the log-prob group still keeps pace with a
    # rollout that would not be any faster, so the shift risks only the job's pace noise.
    workload = replace(get_workload("agentic-7B-64"), iterations=2)
    records = reshape(generate_trace(workload, 0, iterations=2), workload, LengthFamily.LONGER_TURNS, 0)

    def rebased(**params: Any) -> list[Any]:
        result = simulate(
            workload, "dynarl", records=records, params=params, options=SimOptions(iterations=2)
        )
        return [m for m in result.moves if m.reason == Reason.REPLAN_BASE_SPLIT.value]

    [shift] = rebased()
    assert (shift.recipient, shift.gpus, shift.iteration) == ("rollout", 8, 1)
    assert rebased(bounded_replan_margin=0.1) == []


def test_the_live_policy_records_a_placement_it_cannot_switch_to() -> None:
    policy = policy_with()
    policy.placement_changes_supported = False
    policy.replanner.learn(record(Placement.DISAGGREGATED, 95.0))
    assert policy._replan(job(), record(Placement.DISAGGREGATED, 95.0)) is None
    assert policy.mode is Placement.DISAGGREGATED
    assert "not carried out" in policy.replan_note and "colocated saves" in policy.replan_note


def test_a_boundary_after_an_iteration_too_short_to_measure_says_so_rather_than_repeat_the_last() -> None:
    policy = policy_with()
    policy.replanner.learn(record(Placement.DISAGGREGATED, 95.0))
    policy.last_replan = "iteration 0 (disaggregated) took 95s: disaggregated stays"
    policy.ledger.start(3, 0.0)  # iteration 3 ended before the ticks saw its rollout generate
    assert policy.on_iteration_end(job(), 2.0) == []
    assert policy.replan_note.startswith("iteration 3: too little of it seen"), policy.replan_note
    assert policy.mode is Placement.DISAGGREGATED


def test_a_drivers_measurement_of_its_phases_is_read_as_the_placement_model_reads_an_iteration() -> None:
    graph = make_graph(
        make_group("rollout", ROLLOUT, 5, first_device=0),
        make_group("reference", ComponentKind.INFERENCE, 1, first_device=5),
        make_group("actor", ACTOR, 1, first_device=6),
    )
    measured = MeasuredIteration(
        iteration=4,
        duration_s=6.0,
        generate_s=2.0,
        busy_s={ComponentKind.INFERENCE: 0.5, ACTOR: 1.0},
        tokens=3000.0,
    )
    read = measured_record(measured, graph, Placement.DISAGGREGATED)
    assert (read.iteration, read.duration_s, read.total_gpus, read.tokens) == (4, 6.0, 7, 3000.0)
    assert (read.rollout_body_s, read.rollout_body_gpu_s, read.rollout_tail_s) == (2.0, 10.0, 0.0)
    assert (read.pipeline_gpu_s, read.pipeline_overlap_gpu_s) == (1.5, 0.0)
    assert read.idle_s == 2.5  # the boundary: neither generating nor in a pipeline phase


def test_a_boundary_learns_from_the_drivers_measurement_of_the_iteration_it_closes() -> None:
    policy = policy_with()
    policy.ledger.start(3, 0.0)  # the ticks saw too little of iteration 3
    older = MeasuredIteration(iteration=2, duration_s=6.0, generate_s=2.0, busy_s={ACTOR: 1.0}, tokens=1e3)
    policy.observe_iteration(older)
    policy.on_iteration_end(job(), 2.0)
    assert policy.replan_note.startswith("iteration 3: too little of it seen"), policy.replan_note
    policy.ledger.start(4, 3.0)
    policy.observe_iteration(replace(older, iteration=4))
    assert policy.on_iteration_end(job(), 5.0) == []
    assert policy.replan_note.startswith("iteration 4 (disaggregated) took 6.0s: rollout body 2.0s"), (
        policy.replan_note
    )
    assert policy.replanner.last is not None and policy.replanner.last.idle_s == 3.0
    # The driver's report of iteration 5 is not in when the next boundary comes (the reports
    # and the iteration's advance travel separately): iteration 4 is not learnt a second time.
    policy.ledger.start(5, 6.0)
    learnt = policy.replanner.last
    policy.observe_iteration(replace(older, iteration=4, duration_s=60.0))
    assert policy.on_iteration_end(job(), 7.0) == []
    assert policy.replanner.last is learnt
    assert policy.replan_note.startswith("iteration 5: too little of it seen"), policy.replan_note
    restored = policy_with(policy.state_to_json())
    restored.observe_iteration(replace(older, iteration=4, duration_s=60.0))
    restored.ledger.start(4, 8.0)
    restored.on_iteration_end(job(), 9.0)
    assert restored.replanner.last == learnt  # still learnt once, across the state's round trip


def test_a_job_first_looked_at_past_its_first_iteration_learns_from_the_drivers_measurement() -> None:
    """Ticks that fell behind iterations of a second or two: the policy's first look at the job
    is a boundary, read from the driver's report of the iteration that finished."""
    fresh = policy_with({})
    assert not fresh.iteration_advanced(job())  # first seen in its first iteration: nothing ended
    later = make_graph(*job().nodes, iteration=3)
    assert fresh.iteration_advanced(later)
    fresh.observe_iteration(
        MeasuredIteration(iteration=2, duration_s=6.0, generate_s=2.0, busy_s={ACTOR: 1.0}, tokens=1e3)
    )
    driver = SerialDriver(fresh, placement_changes=True)
    driver.next_decision(later, {}, [], 10.0)
    assert driver.iteration_ended
    assert fresh.replan_note.startswith("iteration 2 (disaggregated) took 6.0s: rollout body 2.0s"), (
        fresh.replan_note
    )
    assert fresh.replanner.last is not None and fresh.replanner.last.iteration == 2
    assert not fresh.iteration_advanced(later)  # the next tick of iteration 3 is not a boundary
    # Without a driver's report (ticks alone) the first look learns nothing and says nothing.
    quiet = policy_with({})
    SerialDriver(quiet, placement_changes=True).next_decision(later, {}, [], 10.0)
    assert quiet.replanner.last is None and quiet.replan_note == ""


def test_colocated_is_predicted_with_the_trainer_on_the_gpus_its_valid_sizes_allow() -> None:
    model = PlacementModel(COST, n_minibatches=8)
    last = record(Placement.DISAGGREGATED, 95.0)
    # 2,800 GPU-s of pipeline over 64 GPUs, or over the 16 a trainer limited to 16 ranks spans.
    assert model.colocated_s(last, 16) - model.colocated_s(last) == 2800.0 / 16 - 2800.0 / 64
    # The job that colocates with a trainer on every GPU stays disaggregated when its trainer
    # can only run 1, 2, 4, 8 or 16 ranks: the policy reads that off the trainer's group.
    spans_all, limited = policy_with(), policy_with()
    for policy in (spans_all, limited):
        policy.replanner.learn(last)
    everywhere = replace(job(), iteration=1)
    chosen = spans_all._replan(everywhere, last)
    assert chosen is not None and chosen.placement is Placement.COLOCATED
    sized = replace(job(parallelism=Parallelism(valid_dp=(1, 2, 4, 8, 16))), iteration=1)
    assert limited._replan(sized, last) is None
    assert "disaggregated stays" in limited.replan_note
    # An operator who knows the engines and the trainer cannot share a GPU's memory turns
    # colocated off: the job stays disaggregated, and the boundary says why.
    kept = policy_with(colocate=False)
    kept.replanner.learn(last)
    assert kept._replan(everywhere, last) is None
    assert "disaggregated stays: colocated placement is off (policy.params.colocate)" in kept.replan_note


# -- do no harm, per kind of move --------------------------------------------------------------


def iteration_graph(iteration: int) -> Hypergraph:
    return replace(job(), iteration=iteration)


def test_a_move_kind_that_keeps_losing_stops_being_made_then_gets_a_fresh_trial() -> None:
    policy = policy_with(probation_iterations=2)
    made = []
    why_not: list[str] = []
    for iteration in range(MIN_OUTCOMES + 1):
        graph = iteration_graph(iteration)
        start = 1000.0 * iteration
        signals = drained(graph)
        decisions = policy.decide(graph, signals, [], now=start + 90.0)
        made.append(any(d.recipient == "actor" for d in decisions))
        why_not = [c.rejected_because or "" for c in policy.last_candidates]
        # A signal window after the move would have landed, the trainer is no faster than
        # before it (its data, not its GPUs, limited it): the move gained nothing.
        policy.decide(graph, signals, [], now=start + 150.0)
        policy.on_iteration_end(iteration_graph(iteration + 1), start + 200.0)
    assert made[:MIN_OUTCOMES] == [True] * MIN_OUTCOMES
    assert made[MIN_OUTCOMES] is False
    assert any("rollout>actor moves did not pay on this job" in why for why in why_not)
    kind = policy.outcomes.kinds["rollout>actor"]
    assert kind.suspensions == 1 and kind.ratio <= 0
    # The probation ends: one fresh trial.
    graph = iteration_graph(MIN_OUTCOMES + 1)
    assert policy.decide(graph, drained(graph), [], now=1000.0 * (MIN_OUTCOMES + 1) + 90.0)
    # The record survives the policy being rebuilt from its state, as the tick does.
    again = policy_with(policy.state_to_json())
    assert again.outcomes.kinds["rollout>actor"].suspensions == 1


def test_a_move_that_delivers_its_predicted_throughput_keeps_its_kind_trusted() -> None:
    policy = policy_with()
    for iteration in range(MIN_OUTCOMES + 1):
        graph = iteration_graph(iteration)
        start = 1000.0 * iteration
        [decision] = policy.decide(graph, drained(graph), [], now=start + 90.0)
        assert decision.chosen is not None and decision.chosen.prediction is not None
        rise = decision.chosen.prediction.recipient_after - decision.chosen.prediction.recipient_before
        after = drained(graph)
        after["actor"] = replace(after["actor"], tokens_per_s=rise)  # measured: what was predicted
        policy.decide(graph, after, [], now=start + 150.0)
        policy.on_iteration_end(iteration_graph(iteration + 1), start + 200.0)
    kind = policy.outcomes.kinds["rollout>actor"]
    assert kind.outcomes >= MIN_OUTCOMES and abs(kind.ratio - 1.0) < 1e-6
    assert policy.outcomes.trust("rollout>actor", MIN_OUTCOMES + 1) == (1.0, None)


def test_a_kind_that_gains_less_than_predicted_is_trusted_less() -> None:
    outcomes = MoveOutcomes(probation_iterations=3)
    for iteration in range(MIN_OUTCOMES):
        outcomes.opened(OpenOutcome("rollout>actor", "actor", 100.0, 50.0, measure_after=10.0))
        outcomes.settle(5.0, {"actor": 150.0}, iteration)  # not yet: the window has not seen it
        assert outcomes.open
        outcomes.settle(12.0, {"actor": 120.0}, iteration)  # 20 tokens/s of the 50 predicted
    trust, suspended = outcomes.trust("rollout>actor", iteration=MIN_OUTCOMES)
    assert suspended is None and abs(trust - 0.4) < 1e-9
    assert outcomes.trust("inference>actor", iteration=MIN_OUTCOMES) == (1.0, None)


def test_a_move_its_iteration_outlived_leaves_no_outcome() -> None:
    outcomes = MoveOutcomes(probation_iterations=3)
    outcomes.opened(OpenOutcome("rollout>actor", "actor", 100.0, 50.0, measure_after=10.0))
    outcomes.drop_open()
    outcomes.settle(20.0, {"actor": 0.0}, 1)
    assert outcomes.kinds == {}


def test_a_move_whose_recipient_finished_its_share_before_it_was_measured_leaves_no_outcome() -> None:
    # The log-prob group got GPUs, cleared its queue and went idle before a window could show it
    # at work with them: its throughput by then says its input ran out, not that the move lost.
    outcomes = MoveOutcomes(probation_iterations=3)
    for iteration in range(MIN_OUTCOMES):
        outcomes.opened(OpenOutcome("rollout>inference", "inference", 100.0, 50.0, measure_after=10.0))
        outcomes.settle(12.0, {"inference": 0.0}, iteration, finished={"inference"})
    assert outcomes.open == [] and outcomes.kinds == {}
    assert outcomes.trust("rollout>inference", MIN_OUTCOMES) == (1.0, None)
    # One still at work and short of the prediction is measured as before.
    outcomes.opened(OpenOutcome("rollout>inference", "inference", 100.0, 50.0, measure_after=10.0))
    outcomes.settle(12.0, {"inference": 90.0}, 0, finished={"actor"})
    assert outcomes.kinds["rollout>inference"].outcomes == 1


def test_a_re_planned_split_is_held_against_the_next_iteration() -> None:
    policy = policy_with()
    policy._rollout_base = 8
    policy._rebase_open = ("rebase:actor>rollout", 20.0, 0.1)
    policy.ledger.start(0, 0.0)
    graph = job()
    for now in (1.0, 2.0, 3.0, 4.0):
        policy.ledger.observe(graph, drained(graph, idle=0), now)
    policy._close_iteration(iteration_graph(1), 400.0)
    kind = policy.outcomes.kinds["rebase:actor>rollout"]
    assert kind.outcomes == 1 and kind.ratio < 0  # took far longer than its work at the old pace
    assert policy._rebase_open is None
    assert Reason.REPLAN_BASE_SPLIT.value == "replan_base_split"


def test_the_split_is_re_planned_from_what_the_rollout_owns_not_the_most_it_borrowed() -> None:
    # The rollout owns 8 GPUs. It lent 4 to the trainer and borrowed 2 from the log-prob group
    # for a while (a group idle at the start of a batch lends its GPUs to the rollout); at the
    # boundary it holds 6, and it starts the next iteration with its own 8.
    policy = policy_with()
    graph = make_graph(
        make_group("rollout", ROLLOUT, 3, first_device=0, gpus_per_worker=2),
        make_group("inference", ComponentKind.INFERENCE, 1, first_device=20, gpus_per_worker=2),
        make_group("actor", ACTOR, 4, first_device=50, depends_on=("rollout",)),
    )
    policy.ledger.start(0, 0.0)
    for now in (1.0, 2.0, 3.0, 4.0):
        policy.ledger.observe(graph, drained(graph, idle=0), now)
    policy.loans.lend("rollout", "actor", ["d40", "d41", "d42", "d43"], 2.0)
    policy.loans.lend("inference", "rollout", ["d4", "d5"], 1.0)
    assert policy.ledger.rollout_gpus_max == 6
    policy._close_iteration(replace(graph, iteration=1), 10.0)
    assert policy._rollout_base == 8


def test_a_job_placed_colocated_is_left_to_take_its_turns() -> None:
    # Every GPU group on the same four devices: nothing is proposed (the planner would refuse
    # any move of a time-shared GPU), and the policy knows the job runs colocated.
    rollout = make_group("rollout", ROLLOUT, 4, first_device=0)
    actor = make_group("actor", ACTOR, 4, first_device=0, depends_on=("rollout",))
    graph = make_graph(rollout, actor)
    policy = policy_with()
    assert policy.decide(graph, drained(graph), [], now=90.0) == []
    assert policy.mode is Placement.COLOCATED
    # Only some groups sharing devices is not a colocated placement.
    partly = make_graph(rollout, actor, make_group("inference", ComponentKind.INFERENCE, 2, first_device=10))
    fresh = policy_with()
    fresh.decide(partly, drained(partly), [], now=90.0)
    assert fresh.mode is Placement.DISAGGREGATED


# -- a split re-planned from the driver's timed stages ----------------------------------------


def staged_job(iteration: int, *, rollout: int = 3) -> Hypergraph:
    """A real job's disaggregated split: the rollout's engines, one reference engine, one
    trainer rank, each on GPUs of its own."""
    return make_graph(
        make_group("rollout", ROLLOUT, rollout, first_device=0),
        make_group("reference", ComponentKind.INFERENCE, 1, first_device=rollout),
        make_group("actor", ACTOR, 1, first_device=rollout + 1, depends_on=("rollout",)),
        iteration=iteration,
    )


def timed(iteration: int, *, train_s: float, duration_s: float) -> MeasuredIteration:
    return MeasuredIteration(
        iteration=iteration,
        duration_s=duration_s,
        generate_s=3.0,
        busy_s={ComponentKind.INFERENCE: 1.0, ACTOR: train_s},
        tokens=3000.0,
    )


def test_a_drivers_stages_are_kept_with_their_gpus_and_predict_a_split_stage_by_stage() -> None:
    read = measured_record(timed(3, train_s=24.0, duration_s=30.0), staged_job(3), Placement.DISAGGREGATED)
    assert read.stages == {"rollout": (9.0, 3), "inference": (1.0, 1), "actor": (24.0, 1)}
    model = PlacementModel(COST, n_minibatches=8)
    # The split it ran on takes what it measured; nothing was lent between the stages.
    assert model.disaggregated_s(read, 3) == 30.0
    # One rollout GPU to the trainer: the rollout 1.5 s slower, the train step 12 s faster.
    assert model.staged_s(read, {"rollout": 2, "actor": 2}) == 30.0 + 1.5 - 12.0
    assert IterationRecord.from_json(read.to_json()) == read


def test_a_trainer_bound_real_job_gets_a_rollout_gpu_for_its_trainer_at_the_boundary() -> None:
    # Before, the re-planned split only ever traded GPUs between the rollout and the reference,
    # whatever the trainer's share of the iteration.
    policy = policy_with(colocate=False)
    policy.ledger.start(3, 0.0)
    policy.observe_iteration(timed(3, train_s=24.0, duration_s=30.0))
    decisions = policy.on_iteration_end(staged_job(4), 30.0)
    assert [(d.reason, d.donor, d.recipient, len(d.device_ids)) for d in decisions] == [
        (Reason.REPLAN_BASE_SPLIT, "rollout", "actor", 1)
    ]
    assert "1 GPUs of rollout to actor" in decisions[0].detail, decisions[0].detail
    assert "predicted 35% faster" in decisions[0].detail, decisions[0].detail
    assert policy._rollout_base == 2


def test_a_split_whose_saving_does_not_pay_for_the_move_is_left_and_the_boundary_says_why() -> None:
    # The same shape, smaller: 0.45 s saved an iteration (30%), against a move of about 3 s.
    policy = policy_with(colocate=False)
    policy.ledger.start(3, 0.0)
    policy.observe_iteration(
        MeasuredIteration(
            iteration=3,
            duration_s=1.8,
            generate_s=0.3,
            busy_s={ComponentKind.INFERENCE: 0.1, ACTOR: 1.2},
            tokens=3000.0,
        )
    )
    assert policy.on_iteration_end(staged_job(4), 3.0) == []
    assert (
        "1 GPUs of rollout to actor would save 0.5s an iteration, which does not pay" in policy.replan_note
    ), policy.replan_note
    assert policy._rollout_base == 3
