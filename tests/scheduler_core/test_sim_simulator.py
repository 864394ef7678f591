"""The simulator's accounting, determinism, placements, migrations and staleness."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Decision, Reason
from scheduler.core.hypergraph import Device, Hypergraph, HyperNode, MigrationStrategy
from scheduler.core.policies import POLICY_NAMES, Placement
from scheduler.core.signals import GroupSignals
from scheduler.core.sim.perf import PerfParams
from scheduler.core.sim.runner import build_simulation, simulate
from scheduler.core.sim.simulator import ACTOR, ROLLOUT, SimOptions, Simulation
from scheduler.core.sim.trace import generate_trace, read_trace, write_trace
from scheduler.core.sim.workloads import AgenticTurns, Workload, get_workload

TINY = ("math-tiny", "agentic-tiny", "math-tiny-async")


class ScriptedPolicy:
    """Issues ``script(graph, free)`` once, at the first tick at or after ``at``."""

    name = "scripted"
    params: Mapping[str, Any] = {}

    def __init__(
        self,
        at: float,
        script: Callable[[Hypergraph, Sequence[Device]], list[Decision]],
        placement: Placement = Placement.DISAGGREGATED,
        split: dict[str, int] | None = None,
    ) -> None:
        self.at = at
        self.script = script
        self.placement = placement
        self.split = split
        self.done = False
        self.ended = 0
        self.switch_after: dict[int, Placement] = {}  # iteration -> placement from the next one
        self.refused: list[str] = []
        self.decisions_refused: list[tuple[Decision, str]] = []
        self.graphs: list[Hypergraph] = []
        self.signals: list[Mapping[str, GroupSignals]] = []

    def decide(
        self, graph: Hypergraph, signals: Mapping[str, GroupSignals], free: Sequence[Device], now: float
    ) -> list[Decision]:
        self.graphs.append(graph)
        self.signals.append(signals)
        if self.done or now < self.at:
            return []
        self.done = True
        return self.script(graph, free)

    def plan_initial_split(self, total_gpus: int, groups: Sequence[HyperNode]) -> dict[str, int] | None:
        return self.split

    def on_iteration_end(self, graph: Hypergraph, now: float) -> list[Decision]:
        self.ended = graph.iteration
        return []

    def next_placement(self) -> Replacement | None:
        to = self.switch_after.get(self.ended - 1) if self.switch_after else None
        return Replacement(to, f"scripted switch to {to}") if to is not None else None

    def placement_refused(self, change: Any, why: str) -> None:
        self.refused.append(why)

    def decision_refused(self, decision: Decision, why: str) -> None:
        self.decisions_refused.append((decision, why))


@dataclass(frozen=True)
class Replacement:
    placement: Placement
    detail: str


def move(donor: str | None, recipient: str | None, device_ids: Sequence[str]) -> Decision:
    return Decision(
        policy="scripted",
        reason=Reason.OPERATOR_REQUEST,
        detail="test move",
        donor=donor,
        recipient=recipient,
        device_ids=tuple(device_ids),
        donor_strategy=None,
        recipient_strategy=None,
    )


def scripted_run(
    workload: Workload, policy: ScriptedPolicy, *, seed: int = 0, check: bool = True
) -> tuple[Simulation, Any]:
    simulation = Simulation(
        workload, policy, generate_trace(workload, seed), options=SimOptions(check_invariants=check)
    )
    return simulation, simulation.run()


def expected_tokens(workload: Workload, seed: int = 0) -> tuple[int, int]:
    records = generate_trace(workload, seed)
    return sum(r.total_tokens for r in records), sum(r.generated_tokens for r in records)


@pytest.mark.parametrize("name", TINY)
def test_same_seed_gives_identical_results(name: str) -> None:
    first = simulate(name, "dynarl", seed=5).to_dict()
    again = simulate(name, "dynarl", seed=5).to_dict()
    assert first == again
    assert simulate(name, "dynarl", seed=6).to_dict() != first


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_sample_is_generated_and_trained_once_and_gpus_are_conserved(name: str, policy: str) -> None:
    workload = get_workload(name)
    simulation = build_simulation(workload, policy, options=SimOptions(check_invariants=True))
    result = simulation.run()
    tokens, generated = expected_tokens(workload)
    assert result.tokens == tokens
    assert result.generated_tokens == generated
    assert len(result.iteration_end_s) == workload.iterations
    assert list(result.iteration_end_s) == sorted(result.iteration_end_s)
    assert result.makespan_s == result.iteration_end_s[-1]
    assert simulation.invariant_checks > 100  # ownership was verified after every event
    assert sum(simulation.allocation().values()) == workload.gpus


def test_the_invariant_check_catches_a_gpu_in_two_places() -> None:
    simulation = build_simulation("math-tiny", "static-disaggregated")
    simulation.run()
    simulation.check_invariants()
    device = next(d for d, owner in simulation.owner.items() if owner == ROLLOUT)
    simulation.owner[device] = ACTOR
    with pytest.raises(AssertionError, match="owned by actor"):
        simulation.check_invariants()


def test_colocated_runs_every_stage_on_all_gpus_in_turn() -> None:
    policy = ScriptedPolicy(1e9, lambda g, f: [], placement=Placement.COLOCATED)
    workload = get_workload("math-tiny")
    _, result = scripted_run(workload, policy)
    for graph in policy.graphs:
        holding = [n.id for n in graph.nodes if n.gpus]
        assert len(holding) <= 1  # one stage holds the GPUs at a time (none while switching)
        assert all(n.gpus in (0, workload.gpus) for n in graph.nodes)
    stages = {next(n.id for n in g.nodes if n.gpus) for g in policy.graphs if any(n.gpus for n in g.nodes)}
    assert stages == {"rollout", "inference", "actor"}
    # Two offload/onload switches per iteration except after the last one.
    assert result.colocate_switch_s > 0


def test_a_placement_change_at_a_boundary_rebuilds_the_job_and_keeps_every_gpu_accounted() -> None:
    workload = get_workload("math-tiny-async")  # 4 iterations; asynchronous, so also refused once
    policy = ScriptedPolicy(1e9, lambda g, f: [])
    policy.switch_after = {0: Placement.COLOCATED, 1: Placement.DISAGGREGATED}
    _, result = scripted_run(workload, policy)
    # The asynchronous job generates ahead of its trainer: its placement may not change.
    assert result.placements == ("disaggregated",) * 4
    assert policy.refused and "asynchronous" in policy.refused[0]

    workload = get_workload("math-tiny")
    two = replace(workload, iterations=4)
    policy = ScriptedPolicy(1e9, lambda g, f: [])
    policy.switch_after = {0: Placement.COLOCATED, 2: Placement.DISAGGREGATED}
    _, result = scripted_run(two, policy)
    assert result.placements == ("disaggregated", "colocated", "colocated", "disaggregated")
    assert [c.to for c in result.placement_changes] == ["colocated", "disaggregated"]
    assert all(c.cost_s > 0 for c in result.placement_changes)
    tokens, _ = expected_tokens(two)
    assert result.tokens == tokens  # every sample trained exactly once across the switches
    colocated = [g for g in policy.graphs if g.iteration in (1, 2) and any(n.gpus for n in g.nodes)]
    assert colocated and all(sum(1 for n in g.nodes if n.gpus) == 1 for g in colocated)
    last = [g for g in policy.graphs if g.iteration == 3 and sum(1 for n in g.nodes if n.gpus) == 3]
    assert last, "the last iteration runs disaggregated again, every GPU group holding GPUs"
    assert result.gpu_seconds["in_migration"] > 0  # the switches' GPU-time is accounted


def test_colocated_placement_refuses_moves() -> None:
    def script(graph: Hypergraph, free: Sequence[Device]) -> list[Decision]:
        node = next(n for n in graph.nodes if n.gpus)
        return [move(node.id, None, node.device_ids[:1])]

    policy = ScriptedPolicy(2.0, script, placement=Placement.COLOCATED)
    _, result = scripted_run(get_workload("math-tiny"), policy)
    assert result.migrations == 0
    assert any("colocated" in problem for problem in result.rejected_by_problem)


def test_a_move_takes_back_requests_and_pays_both_sides_costs() -> None:
    workload = get_workload("math-tiny")
    moved: list[str] = []

    def script(graph: Hypergraph, free: Sequence[Device]) -> list[Decision]:
        rollout = graph.node(ROLLOUT)
        moved.extend(rollout.device_ids[:4])
        return [move(ROLLOUT, ACTOR, moved)]

    policy = ScriptedPolicy(2.0, script)
    simulation, result = scripted_run(workload, policy)
    assert result.migrations == 1
    record = result.moves[0]
    cost = MigrationCostModel(model_params_b=workload.model_spec.params_b)
    assert record.requests_taken_back > 0
    assert record.donor_cost_s == pytest.approx(
        cost.estimate_s(
            MigrationStrategy.WORKLOAD,
            gpus_moved=4,
            recipient_gpus_after=result.initial_split[ROLLOUT] - 4,
            requests_taken_back=record.requests_taken_back,
        )
    )
    assert record.recipient_cost_s == pytest.approx(
        cost.estimate_s(
            MigrationStrategy.P2P, gpus_moved=4, recipient_gpus_after=result.initial_split[ACTOR] + 4
        )
    )
    # The GPUs ended with the actor; the taken-back requests were finished by other engines.
    assert all(simulation.owner[d] == ACTOR for d in moved)
    later = policy.graphs[-1]
    assert later.node(ACTOR).gpus == result.initial_split[ACTOR] + 4
    assert result.reprefilled_tokens > 0
    assert result.tokens == expected_tokens(workload)[0]
    # The trainer paused while receiving state: that is online overhead.
    assert result.migration_gpu_s > 4 * (record.donor_cost_s + record.recipient_cost_s)
    assert 0 < result.online_overhead < 1


def test_devices_in_transit_belong_to_nobody_until_the_move_lands() -> None:
    def script(graph: Hypergraph, free: Sequence[Device]) -> list[Decision]:
        return [move(ROLLOUT, ACTOR, graph.node(ROLLOUT).device_ids[:2])]

    policy = ScriptedPolicy(2.0, script)
    scripted_run(get_workload("math-tiny"), policy)
    totals = [g.gpus for g in policy.graphs]
    assert min(totals) == get_workload("math-tiny").gpus - 2  # two GPUs seen in transit
    assert totals[-1] == get_workload("math-tiny").gpus


@pytest.mark.parametrize(
    ("script", "problem"),
    [
        (lambda g, f: [move(ACTOR, ROLLOUT, g.node(ROLLOUT).device_ids[:1])], "belongs to rollout"),
        (lambda g, f: [move(ROLLOUT, "reward", g.node(ROLLOUT).device_ids[:1])], "runs on CPUs"),
        (lambda g, f: [move(ROLLOUT, ACTOR, g.node(ROLLOUT).device_ids)], "without workers"),
        (lambda g, f: [move(None, ACTOR, ["nowhere"])], "unknown device"),
        (lambda g, f: [move(None, None, g.node(ROLLOUT).device_ids[:1])], "neither a donor nor a recipient"),
    ],
)
def test_invalid_decisions_are_rejected_with_the_reason(
    script: Callable[[Hypergraph, Sequence[Device]], list[Decision]], problem: str
) -> None:
    workload = get_workload("math-tiny")
    policy = ScriptedPolicy(2.0, script)
    _, result = scripted_run(workload, policy)
    assert result.migrations == 0
    assert any(problem in p for p in result.rejected_by_problem), result.rejected_by_problem
    # The policy is told, so it stops awaiting the move and puts its loan book back.
    assert [why for _, why in policy.decisions_refused] == list(result.rejected_by_problem)
    assert result.tokens == expected_tokens(workload)[0]


def test_released_devices_go_to_the_free_pool_and_can_be_taken_back() -> None:
    state: dict[str, list[str]] = {}

    class ReleaseThenGrow(ScriptedPolicy):
        def decide(
            self, graph: Hypergraph, signals: Mapping[str, GroupSignals], free: Sequence[Device], now: float
        ) -> list[Decision]:
            super().decide(graph, signals, free, now)
            if now == 2.0:
                state["released"] = list(graph.node(ROLLOUT).device_ids[:2])
                return [move(ROLLOUT, None, state["released"])]
            if now == 5.0:
                assert sorted(d.id for d in free) == sorted(state["released"])
                return [move(None, ACTOR, [d.id for d in free])]
            return []

    policy = ReleaseThenGrow(1e9, lambda g, f: [])
    simulation, result = scripted_run(get_workload("math-tiny"), policy)
    assert result.migrations == 2
    assert all(simulation.owner[d] == ACTOR for d in state["released"])


def test_a_policy_split_is_used_when_valid_and_refused_otherwise() -> None:
    workload = get_workload("math-tiny")
    good = {ACTOR: 4, ROLLOUT: 8, "inference": 4}
    _, result = scripted_run(workload, ScriptedPolicy(1e9, lambda g, f: [], split=good))
    assert result.initial_split == good and result.split_note == "policy"
    bad = {ACTOR: 3, ROLLOUT: 8, "inference": 4}  # 3 is not a divisor of the mini-batch
    _, result = scripted_run(workload, ScriptedPolicy(1e9, lambda g, f: [], split=bad))
    assert result.initial_split != bad and "rejected" in result.split_note


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_async_staleness_never_exceeds_alpha(policy: str) -> None:
    workload = get_workload("math-tiny-async")
    result = simulate(workload, policy)
    if result.placement == "colocated":
        assert result.staleness_bound == 0 and result.max_staleness == 0
    else:
        assert result.staleness_bound == 1
        assert result.max_staleness == 1  # bounded, and the overlap did happen
    wider = simulate(replace(workload, staleness=2), "static-disaggregated")
    assert 1 <= wider.max_staleness <= 2
    sync = simulate(replace(workload, staleness=None), "static-disaggregated")
    assert sync.max_staleness == 0
    assert wider.makespan_s < sync.makespan_s  # generating ahead overlaps the trainer


def test_replaying_a_written_trace_equals_the_generator_run(tmp_path: Path) -> None:
    for name in ("math-tiny", "agentic-tiny"):
        path = tmp_path / f"{name}.jsonl"
        write_trace(path, generate_trace(get_workload(name), 11), workload=name)
        replayed = simulate(name, "dynarl", records=read_trace(path)).to_dict()
        assert replayed == simulate(name, "dynarl", seed=11).to_dict()


def test_the_rollout_tail_shows_in_simulated_time() -> None:
    """~95% of a math iteration's episodes are done by 60% of the time the last one takes."""
    result = simulate("math-1.5B-64", "static-colocated", iterations=1)
    assert 0.9 <= result.done_by_60pct_of_last[0] <= 0.99


def test_priority_routing_reprefills_less_than_fifo_under_kv_pressure() -> None:
    workload = replace(
        get_workload("agentic-tiny"),
        name="agentic-contended",
        gpus=8,
        prompts_per_iteration=32,
        samples_per_prompt=16,
        prompts_per_minibatch=8,
        max_running_requests=32,
        tool_workers=4,
        tool_slots=64,
        perf=PerfParams(engine_mem_fraction=0.06),  # a small KV pool: finished turns get evicted
    )
    for seed in (0, 1):
        priority = simulate(
            workload, "static-disaggregated", seed=seed, options=SimOptions(router_mode="priority")
        )
        fifo = simulate(workload, "static-disaggregated", seed=seed, options=SimOptions(router_mode="fifo"))
        assert priority.router_mode == "priority" and fifo.router_mode == "fifo"
        assert 0 < priority.reprefilled_tokens < fifo.reprefilled_tokens
        assert priority.affinity_hits >= fifo.affinity_hits


@dataclass
class Tick:
    """What the rollout's engines held when the policy was called."""

    batches: dict[str, int]  # running requests, by engine
    waiting: int  # requests in the router's queue
    queued_on_engines: int  # requests handed to an engine and not yet admitted


def grow_rollout_mid_batch(
    workload: Workload, at: float, seen: dict[str, Any] | None = None
) -> tuple[Simulation, Any, list[Tick], list[str]]:
    """A rollout of 4 engines grown by 4 of the log-prob group's GPUs at ``at``; every tick's
    engines recorded, and every engine that ever ran kept in ``seen``."""
    split = {ACTOR: 4, ROLLOUT: 4, "inference": 8}
    moved: list[str] = []
    ticks: list[Tick] = []

    def script(graph: Hypergraph, free: Sequence[Device]) -> list[Decision]:
        moved.extend(graph.node("inference").device_ids[:4])
        return [move("inference", ROLLOUT, moved)]

    class Watching(ScriptedPolicy):
        def decide(
            self, graph: Hypergraph, signals: Mapping[str, GroupSignals], free: Sequence[Device], now: float
        ) -> list[Decision]:
            engines = simulation.engines
            if seen is not None:
                seen.update(engines)
            ticks.append(
                Tick(
                    {w: e.batch for w, e in engines.items()},
                    len(simulation.router),
                    sum(len(e.local) for e in engines.values()),
                )
            )
            return super().decide(graph, signals, free, now)

    simulation = Simulation(
        workload,
        Watching(at, script, split=split),
        generate_trace(workload, 0),
        options=SimOptions(check_invariants=True),
    )
    result = simulation.run()
    assert result.migrations == 1
    assert result.tokens == expected_tokens(workload)[0]  # every sample trained, none twice
    return simulation, result, ticks, moved


def test_engines_that_join_a_rollout_mid_batch_take_follow_up_turns() -> None:
    # Every episode is admitted at once on the first engines; a follow-up turn asks for the
    # engine holding its cache, which has room for it. Engines started on GPUs moved to the
    # rollout mid-batch get work only because the router balances the load.
    workload = replace(
        get_workload("agentic-tiny"),
        model="7B",
        samples_per_prompt=32,
        max_running_requests=128,
        tool_workers=8,
        tool_slots=64,
        iterations=1,
        agentic=AgenticTurns(first_response_median=1200.0, response_decay=1.0, tool_latency_median_s=0.5),
    )
    engines: dict[str, Any] = {}  # every engine that ever ran, kept past its end
    simulation, result, _, moved = grow_rollout_mid_batch(workload, 2.0, engines)
    joined = [e for e in engines.values() if any(d.id in moved for d in e.devices)]
    first = [e for e in engines.values() if not any(d.id in moved for d in e.devices)]
    assert len(joined) == 4 and len(first) == 4
    # The engines that joined decoded a real share of the batch, with the caches they lacked
    # prefilled again.
    first_mean = sum(e.decoded_tokens for e in first) / len(first)
    assert min(e.decoded_tokens for e in joined) > 0.2 * first_mean
    assert simulation.router.stats.affinity_steals > 0
    assert result.reprefilled_tokens > 0


def test_engines_that_join_a_rollout_mid_generation_take_a_share_of_the_running_requests() -> None:
    # The whole batch runs on the first four engines from the start: nothing is queued that a
    # router could send to engines joining later. As the real driver's shed_requests step does,
    # the old engines abort their share of what they run, and the new ones resume it.
    workload = replace(get_workload("math-tiny"), model="7B", max_running_requests=128, iterations=1)
    _, result, ticks, _ = grow_rollout_mid_batch(workload, 1.0)
    last_before = max(i for i, t in enumerate(ticks) if len(t.batches) == 4)
    before, after = ticks[last_before], ticks[last_before + 1]
    # Most of the batch running, none of it waiting.
    assert before.waiting + before.queued_on_engines == 0 and sum(before.batches.values()) > 64
    assert len(after.batches) == 8
    joined = {w: n for w, n in after.batches.items() if w not in before.batches}
    # Half the engines are new: each old one gave up about half of what it ran.
    assert sum(joined.values()) >= 0.4 * sum(after.batches.values())
    assert all(after.batches[w] <= 0.6 * n for w, n in before.batches.items())
    assert result.reprefilled_tokens > 0


def test_engines_that_join_a_rollout_with_requests_waiting_take_those_and_abort_nothing() -> None:
    # Four engines of eight slots each: most of the batch waits in the router. The new engines'
    # share comes from what waits; no running request is aborted to be prefilled again.
    workload = replace(get_workload("math-tiny"), model="7B", max_running_requests=8, iterations=1)
    _, result, ticks, _ = grow_rollout_mid_batch(workload, 1.0)
    joined_at = next(i for i, t in enumerate(ticks) if len(t.batches) == 8)
    assert ticks[joined_at - 1].waiting >= 64  # enough waiting to fill every engine
    assert all(n == 8 for n in ticks[joined_at].batches.values())  # the new ones from the queue
    assert result.reprefilled_tokens == 0


def test_telemetry_reaches_the_policy_as_group_signals() -> None:
    policy = ScriptedPolicy(1e9, lambda g, f: [])
    scripted_run(get_workload("math-tiny"), policy, check=False)
    first = policy.signals[0]
    assert set(first) == {"rollout", "inference", "actor", "reward"}
    assert first["rollout"].utilisation_mean > 0.2 and first["rollout"].in_flight > 0
    assert first["rollout"].max_in_flight_per_worker == get_workload("math-tiny").max_running_requests
    # By the end of an iteration the rollout has drained: its workers sit under U_low.
    assert any(s["rollout"].low_utilisation_fraction > 0.5 for s in policy.signals)
    assert any(s["actor"].tokens_per_s > 0 for s in policy.signals)


def test_a_multi_turn_trace_replays_on_any_workload() -> None:
    records = generate_trace(get_workload("agentic-tiny"), 0)
    result = simulate("math-tiny", "static-disaggregated", records=records)
    assert result.tokens == sum(r.total_tokens for r in records)
    assert result.generated_tokens == sum(r.generated_tokens for r in records)


class LendFinishedRollout(ScriptedPolicy):
    """Moves every engine to the trainer once the rollout's batch is done, and back at the
    iteration's end (as a synchronous job's drained rollout may)."""

    def __init__(self) -> None:
        super().__init__(0.0, lambda g, f: [])
        self.lent: list[str] = []
        self.refused: list[str] = []

    def decide(
        self, graph: Hypergraph, signals: Mapping[str, GroupSignals], free: Sequence[Device], now: float
    ) -> list[Decision]:
        super().decide(graph, signals, free, now)
        rollout = graph.node(ROLLOUT)
        if self.lent or not rollout.workers or signals[ROLLOUT].progress < 1.0:
            return []
        self.lent = list(rollout.device_ids)
        return [move(ROLLOUT, ACTOR, self.lent)]

    def on_iteration_end(self, graph: Hypergraph, now: float) -> list[Decision]:
        lent, self.lent = self.lent, []
        return [move(ACTOR, ROLLOUT, lent)] if lent else []


def test_a_synchronous_rollout_may_give_up_every_engine_once_its_batch_is_done() -> None:
    workload = get_workload("math-tiny")
    policy = LendFinishedRollout()
    simulation, result = scripted_run(workload, policy)
    assert result.rejected_by_problem == {}
    assert result.migrations >= 2 * (workload.iterations - 1)
    assert any(graph.node(ROLLOUT).gpus == 0 for graph in policy.graphs)  # no engine left
    assert result.tokens == expected_tokens(workload)[0]  # and every batch was still generated
    assert sum(simulation.allocation().values()) == workload.gpus


def test_an_asynchronous_rollout_keeps_an_engine_even_when_drained() -> None:
    workload = get_workload("math-tiny-async")
    _, result = scripted_run(workload, LendFinishedRollout())
    assert any("without workers" in problem for problem in result.rejected_by_problem)
    assert result.tokens == expected_tokens(workload)[0]


@pytest.mark.parametrize("policy", ["static-colocated", "static-disaggregated", "dynarl"])
def test_gpu_time_is_accounted_for_every_gpu_and_second(policy: str) -> None:
    workload = get_workload("math-tiny")
    result = simulate(workload, policy)
    spent = result.gpu_seconds
    total = sum(spent.values())
    # Charged at every one-second tick: all GPUs, up to the last tick before the end.
    assert workload.gpus * (result.makespan_s - 1.0) <= total <= workload.gpus * result.makespan_s + 1e-6
    assert sum(sum(it.values()) for it in result.gpu_seconds_by_iteration) == pytest.approx(total)
    assert len(result.gpu_seconds_by_iteration) == workload.iterations
    assert spent["rollout_decoding"] > 0 and spent["trainer_busy"] > 0
    if policy == "static-colocated":
        assert spent["colocated_switch"] > 0 and spent["in_migration"] == 0
    else:
        assert spent["colocated_switch"] == 0
    if result.migrations == 0:
        assert spent["in_migration"] == 0
