"""The discrete-event cluster simulator: one RL job, one policy, virtual time.

Events sit on a heap keyed by (virtual time, order, sequence); ties resolve by insertion order, so
a run is a pure function of (workload, trace, policy, options). Engines are woken only at their
next completion (see ``engine.py``); telemetry is sampled every ``tick_s`` from the stages'
integrals, folded by the ``SignalAggregator`` and handed to ``policy.decide``, whose decisions are
applied as migrations with the costs of ``MigrationCostModel``.

Placement:

- DISAGGREGATED: every group owns its GPUs; stages overlap (rollout -> reward -> log-prob ->
  trainer, mini-batch by mini-batch) and decisions move GPUs between groups.
- COLOCATED: all GPUs run one stage at a time (rollout, then log-probs, then training), paying an
  offload/onload switch between the rollout and the trainer's stages; decisions cannot apply.

A policy that re-plans (``next_placement``) may switch between the two at an iteration boundary
of a synchronous job: every worker stops, the trainer's state spreads to every GPU (or gathers
back onto the trainer's), engines start, and the next iteration runs under the new placement.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.rl.router import DataRouter, RoutedRequest, RouterMode
from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Decision
from scheduler.core.hypergraph import (
    ComponentKind,
    Device,
    HyperEdge,
    Hypergraph,
    HyperNode,
    MigrationStrategy,
    Parallelism,
    Worker,
)
from scheduler.core.policies.base import Placement, PlacementChange
from scheduler.core.signal_window import SignalAggregator
from scheduler.core.signals import GroupSignals, WorkerSample
from scheduler.core.sim.engine import Engine, SimRequest
from scheduler.core.sim.episodes import Episode
from scheduler.core.sim.hardware import HARDWARE
from scheduler.core.sim.perf import EngineCoeffs, PerfModel
from scheduler.core.sim.results import MoveRecord, PlacementChangeRecord, SimResult, percentile
from scheduler.core.sim.stages import (
    ACTOR,
    INFERENCE,
    LOG_PROB_PASSES,
    REWARD,
    ROLLOUT,
    TOOL,
    CpuPool,
    CpuWorker,
    LogProbPool,
    LogProbWorker,
    MiniBatch,
    SampleMark,
    Trainer,
    TrainerWorker,
    stage_switch_s,
)
from scheduler.core.sim.trace import TraceRecord, decode_weighted_context, group_by_iteration
from scheduler.core.sim.workloads import Workload, WorkloadKind

GPU_GROUPS = (ROLLOUT, INFERENCE, ACTOR)
FREE = ""

# Event kinds, in the order they run when they fall on the same instant: work first, then
# migration steps, then the telemetry tick that lets the policy see the result.
(
    ENGINE,
    CPU_DONE,
    LOGPROB_DONE,
    TRAIN_DONE,
    WEIGHTS_SYNCED,
    MOVE_RELEASE,
    MOVE_READY,
    PHASE,
    PLACEMENT,
    TICK,
) = range(10)
# Owner of the devices while the job changes placement.
REPLACING = "~move:placement"

# What a GPU-second went to (``SimResult.gpu_seconds``): an engine's useful decode and prefill
# relative to a full engine, the rest of an engine holding requests (a drained engine's
# stragglers, an engine not yet full), an engine holding none; log-prob and trainer workers busy
# or idle (trainer ranks beyond the valid data-parallel size idle); GPUs moving between groups,
# switching stages (colocated), or unowned.
GPU_TIME_KINDS = (
    "rollout_decoding",
    "rollout_partly_idle",
    "rollout_empty",
    "log_prob_busy",
    "log_prob_idle",
    "trainer_busy",
    "trainer_idle",
    "in_migration",
    "colocated_switch",
    "free",
)

LOG_PROB_MICRO_BATCH_TOKENS = 65536


class SimPolicy(Protocol):
    """What the simulator needs from a policy (``scheduler.core.policies.SchedulingPolicy``)."""

    name: str
    placement: Placement

    def decide(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> list[Decision]: ...

    def plan_initial_split(self, total_gpus: int, groups: Sequence[HyperNode]) -> dict[str, int] | None: ...

    def on_iteration_end(
        self, graph: Hypergraph, now: float, signals: Mapping[str, GroupSignals] | None = None
    ) -> list[Decision]: ...

    def next_placement(self) -> PlacementChange | None: ...

    def placement_refused(self, change: PlacementChange, why: str) -> None: ...

    def decision_refused(self, decision: Decision, why: str) -> None: ...


class SimulationStalled(RuntimeError):
    """Nothing progressed for ``stall_s`` of virtual time (e.g. a group left without workers)."""


@dataclass(frozen=True)
class SimOptions:
    tick_s: float = 1.0
    window_s: float = 10.0
    u_low: float | None = None  # the aggregator's U_low; None: the policy's ``u_low`` or 0.2
    router_mode: str | None = None  # overrides the workload's
    iterations: int | None = None  # run at most this many of the trace's iterations
    check_invariants: bool = False  # verify GPU ownership after every event (slow; for tests)
    stall_s: float = 3600.0
    observe_every_s: float = 10.0  # predictor observations per group at most this often


class BatchEpisode(Episode):
    """An episode of the trace's iteration ``batch``."""

    __slots__ = ("batch", "idx", "rollout_done_at", "version")

    def __init__(self, idx: int, record: TraceRecord, batch: int) -> None:
        super().__init__(record)
        self.idx = idx
        self.batch = batch
        self.version = -1
        self.rollout_done_at = -1.0


@dataclass
class Move:
    id: int
    decision: Decision
    devices: tuple[str, ...]
    started_at: float
    donor_cost_s: float
    taken_back: list[SimRequest] = field(default_factory=list)
    released_at: float = 0.0
    ready_at: float = 0.0
    recipient_cost_s: float = 0.0


@dataclass
class BatchState:
    episodes: list[int]
    prompt_remaining: dict[str, int]  # prompt id -> samples not yet through log-probs
    prompts_left: int
    minibatches_total: int
    ready_prompts: list[str] = field(default_factory=list)
    minibatches_formed: int = 0
    submitted: bool = False
    submitted_at: float = 0.0
    rollout_left: int = 0
    rewarded: int = 0
    trained_at: float = -1.0


def decode_alone_s(coeffs: EngineCoeffs, context_tokens: int, tokens: int) -> float:
    """A lower bound on the seconds to decode ``tokens`` after ``context_tokens``: every step reads
    at least the weights and the request's own KV (the memory side of a batch-1 step)."""
    context_sum = tokens * context_tokens + tokens * (tokens - 1) / 2.0
    return tokens * (coeffs.fixed_s + coeffs.weights_s) + coeffs.per_context_token_s * context_sum


class EngineLoads(Mapping[str, int]):
    """Each engine's load as the router weighs it (requests running or waiting on it), read when
    asked: the router looks up only the few engines with follow-up turns waiting for them."""

    def __init__(self, engines: Mapping[str, Engine]) -> None:
        self._engines = engines

    def __getitem__(self, worker_id: str) -> int:
        engine = self._engines[worker_id]
        return engine.batch + len(engine.local)

    def __iter__(self) -> Iterator[str]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)


class Simulation:
    """One job under one policy; ``run()`` once, then read the result (and, in tests, the state)."""

    def __init__(
        self,
        workload: Workload,
        policy: SimPolicy,
        records: Sequence[TraceRecord],
        *,
        cost_model: MigrationCostModel | None = None,
        options: SimOptions | None = None,
        observe: Callable[[str, ComponentKind, int, float, float], None] | None = None,
    ) -> None:
        self.workload = workload
        self.policy = policy
        self.options = options or SimOptions()
        self.model = workload.model_spec
        self.perf = PerfModel(self.model, workload.perf)
        self.cost_model = cost_model or MigrationCostModel(model_params_b=self.model.params_b)
        self.observe = observe
        self.colocated = policy.placement is Placement.COLOCATED
        self.placements: list[str] = []  # per iteration, the placement it ran under
        self.placement_changes: list[tuple[float, int, str, float, str]] = []  # at, iteration, to, cost, why
        # A colocated job cannot overlap rollout with training, so it runs synchronously.
        self.staleness = 0 if self.colocated or workload.staleness is None else workload.staleness
        policy_u_low = getattr(policy, "params", {}).get("u_low")
        u_low = self.options.u_low if self.options.u_low is not None else policy_u_low
        self.aggregator = SignalAggregator(
            window_s=self.options.window_s,
            u_low=float(u_low) if u_low is not None else 0.2,
            sample_period_s=self.options.tick_s,
        )
        mode = self.options.router_mode or workload.router_mode
        self.router_mode = mode
        self.router = DataRouter(mode=RouterMode(mode))

        self.now = 0.0
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._ids = 0
        self._last_progress = 0.0

        # Cluster and ownership.
        self.devices: list[Device] = []
        for n, hardware in enumerate(workload.hardware_of_nodes()):
            node = f"node{n:03d}"
            spec = HARDWARE[hardware]
            for i in range(workload.gpus_per_node):
                self.devices.append(
                    Device(id=f"{node}-gpu{i}", node=node, hardware=hardware, memory_gb=spec.hbm_gb, index=i)
                )
        self.device_by_id = {d.id: d for d in self.devices}
        self.owner: dict[str, str] = {d.id: FREE for d in self.devices}

        # Work.
        batches = group_by_iteration(records, workload.episodes_per_iteration)
        if self.options.iterations is not None:
            batches = batches[: self.options.iterations]
        if not batches:
            raise ValueError("the trace has no records")
        self.episodes: list[BatchEpisode] = []
        self.batches: list[BatchState] = []
        for b, batch_records in enumerate(batches):
            prompts: dict[str, int] = {}
            indices = []
            for record in batch_records:
                episode = BatchEpisode(len(self.episodes), record, b)
                self.episodes.append(episode)
                indices.append(episode.idx)
                prompts[record.prompt_id] = prompts.get(record.prompt_id, 0) + 1
            self.batches.append(
                BatchState(
                    episodes=indices,
                    prompt_remaining=prompts,
                    prompts_left=len(prompts),
                    minibatches_total=math.ceil(len(prompts) / workload.prompts_per_minibatch),
                    rollout_left=len(indices),
                )
            )
        all_records = [e.record for e in self.episodes]
        # The context a decode step reads per sequence: what "a full engine" means for utilisation.
        self.typical_context = decode_weighted_context(all_records)
        self._longest_context = max(r.total_tokens for r in all_records)
        self._check_engine_fits(self._longest_context)
        self._pending_placement: PlacementChange | None = None

        # Stages.
        self.engines: dict[str, Engine] = {}
        self.engine_loads = EngineLoads(self.engines)
        self.reward = CpuPool(REWARD, workload.reward_workers, workload.reward_slots, 0.0)
        # A replayed trace may carry multi-turn episodes whatever the workload's kind says.
        needs_tools = workload.kind is WorkloadKind.AGENTIC or any(r.turns > 1 for r in all_records)
        self.tool = CpuPool(TOOL, workload.tool_workers, workload.tool_slots, 0.0) if needs_tools else None
        self.logprob = LogProbPool(self.perf, LOG_PROB_MICRO_BATCH_TOKENS, LOG_PROB_PASSES)
        self.trainer = Trainer(self.perf, workload.valid_trainer_dp)
        self.trainer_version = 0  # batches trained
        self.rollout_version = 0  # the weights the engines serve
        self.phase = ROLLOUT  # colocated: the stage holding the GPUs

        # Telemetry state.
        self._marks: dict[str, SampleMark] = {}  # worker -> its integrals at its last sample
        # Where the GPU-time goes, per iteration being trained (``GPU_TIME_KINDS``), from the ticks.
        self.gpu_time: list[dict[str, float]] = []
        self._group_changed_at: dict[str, float] = {g: 0.0 for g in GPU_GROUPS}
        self._last_observed: dict[str, float] = {}

        # Results.
        self.moves: dict[int, Move] = {}
        self.move_records: list[MoveRecord] = []
        self.rejected: list[tuple[float, str, str]] = []
        self.decision_latencies_s: list[float] = []
        self.decisions_issued = 0
        self.colocate_switch_s = 0.0
        self.staleness_seen: list[int] = []
        self.tokens_trained = 0
        self.generated_tokens = 0
        self.initial_split: dict[str, int] = {}
        self.split_note = ""
        self.iteration_end_s: list[float] = []
        self.invariant_checks = 0
        self.retired_retractions = 0
        self.retired_reprefilled = 0
        self._trainer_tokens_mark = 0.0
        self._trainer_busy_mark = 0.0

    # == setup ==================================================================================

    def _check_engine_fits(self, longest_context: int) -> None:
        for hardware in sorted({d.hardware for d in self.devices}):
            coeffs = self.perf.engine_coeffs(HARDWARE[hardware], colocated=self.colocated)
            if coeffs.kv_capacity_tokens < longest_context:
                raise ValueError(
                    f"an engine on {hardware} holds {coeffs.kv_capacity_tokens} KV tokens, less than the "
                    f"longest episode ({longest_context})"
                )

    def _new_id(self, group: str) -> str:
        self._ids += 1
        return f"{group}-w{self._ids}"

    def _gpus_per_worker(self, group: str) -> int:
        if group == ROLLOUT:
            return self.model.rollout_tp
        return self.model.trainer_gpus_per_worker

    def _spec_nodes(self, split: Mapping[str, int]) -> list[HyperNode]:
        """The groups as HyperNodes, GPU groups holding ``split`` GPUs (devices from rank 0 up)."""
        nodes = []
        cursor = 0
        for group in self._gpu_groups():
            gpus = split.get(group, 0)
            size = self._gpus_per_worker(group)
            workers = tuple(
                Worker(
                    id=f"{group}-plan{i}",
                    devices=tuple(self.devices[cursor + i * size : cursor + (i + 1) * size]),
                )
                for i in range(gpus // size)
            )
            cursor += gpus
            nodes.append(self._node(group, workers))
        nodes.extend(self._cpu_nodes())
        return nodes

    def _gpu_groups(self) -> tuple[str, ...]:
        # RLinf's placement order (actor, rollout, inference) keeps each group on contiguous ranks.
        if self.workload.log_prob_group:
            return (ACTOR, ROLLOUT, INFERENCE)
        return (ACTOR, ROLLOUT)

    def spec_split(self) -> dict[str, int]:
        """The job spec's split, as an operator balancing the pipeline with the performance model
        would pick it (BiDiRL's planner does the same): minimise the slowest stage's time per
        iteration at mean lengths; the rollout takes its work at full engines plus one request of
        ``max_new_tokens`` decoded alone (the straggler may start in the last wave); the actor runs
        at a valid data-parallel size."""
        records = [self.episodes[i].record for i in self.batches[0].episodes]
        hardware = HARDWARE[self.devices[0].hardware]
        coeffs = self.perf.engine_coeffs(hardware)
        mean_prompt = sum(r.prompt_tokens for r in records) / len(records)
        engine_rate = self.perf.engine_peak_tokens_per_s(
            coeffs, self.workload.max_running_requests, self.typical_context, self.workload.max_new_tokens
        )
        rollout_gpu_s = sum(r.generated_tokens for r in records) / engine_rate * self.model.rollout_tp
        longest_decode_s = decode_alone_s(coeffs, round(mean_prompt), self.workload.max_new_tokens)
        sequences = [r.total_tokens for r in records]
        gpu_rate = self.perf.compute_rate([hardware])
        train_gpu_s = self.perf.train_flops(sequences) / gpu_rate
        logprob_gpu_s = LOG_PROB_PASSES * self.perf.forward_flops(sequences) / gpu_rate
        total = self.workload.gpus
        unit = self.model.trainer_gpus_per_worker
        best: tuple[tuple[float, int], dict[str, int]] | None = None
        for dp in self.workload.valid_trainer_dp:
            actor = dp * unit
            inference_options = (
                range(unit, total - actor, unit) if self.workload.log_prob_group else range(0, 1)
            )
            for inference in inference_options:
                rollout = total - actor - inference
                rollout -= rollout % self.model.rollout_tp
                if rollout < self.model.rollout_tp:
                    continue
                slowest = max(
                    rollout_gpu_s / rollout + longest_decode_s,
                    train_gpu_s / actor,
                    logprob_gpu_s / inference if inference else 0.0,
                )
                key = (slowest, -rollout)
                if best is None or key < best[0]:
                    split = {ACTOR: actor, ROLLOUT: rollout}
                    if self.workload.log_prob_group:
                        split[INFERENCE] = inference
                    best = (key, split)
        if best is None:
            raise ValueError(f"{total} GPUs cannot hold every group of {self.workload.name}")
        return best[1]

    def _initial_split(self) -> dict[str, int]:
        spec = self.spec_split()
        planned = self.policy.plan_initial_split(self.workload.gpus, self._spec_nodes(spec))
        if planned is None:
            self.split_note = "job spec"
            return spec
        problem = self._split_problem(planned)
        if problem:
            self.split_note = f"policy split {planned} rejected ({problem}); job spec used"
            return spec
        self.split_note = "policy"
        return {g: int(planned.get(g, 0)) for g in self._gpu_groups()}

    def _split_problem(self, split: Mapping[str, int]) -> str | None:
        unknown = set(split) - set(self._gpu_groups()) - {REWARD, TOOL}
        if unknown:
            return f"unknown groups {sorted(unknown)}"
        if any(split.get(g, 0) for g in (REWARD, TOOL)):
            return "reward and tool groups run on CPUs here"
        if sum(split.values()) > self.workload.gpus:
            return "more GPUs than the job has"
        for group in self._gpu_groups():
            gpus = split.get(group, 0)
            if gpus <= 0 or gpus % self._gpus_per_worker(group):
                return f"{group} needs a positive multiple of {self._gpus_per_worker(group)} GPUs"
        workers = split[ACTOR] // self.model.trainer_gpus_per_worker
        if workers not in self.workload.valid_trainer_dp:
            valid = list(self.workload.valid_trainer_dp)
            return f"the actor cannot run {workers} data-parallel workers (valid: {valid})"
        return None

    # == events =================================================================================

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, kind, self._seq, kind, payload))

    def run(self) -> SimResult:
        wall_start = time.perf_counter()
        if self.colocated:
            self.initial_split = {g: self.workload.gpus for g in self._gpu_groups()}
            self.split_note = "colocated: every stage on all GPUs in turn"
            self._assign_all(ROLLOUT, 0.0)
        else:
            self.initial_split = self._initial_split()
            cursor = 0
            for group in self._gpu_groups():
                gpus = self.initial_split[group]
                self._add_workers(group, tuple(d.id for d in self.devices[cursor : cursor + gpus]), 0.0)
                cursor += gpus
        self._submit_allowed_batches(0.0)
        self._push(self.options.tick_s, TICK, None)
        handlers: dict[int, Callable[[Any], None]] = {
            ENGINE: self._on_engine,
            CPU_DONE: self._on_cpu_done,
            LOGPROB_DONE: self._on_logprob_done,
            TRAIN_DONE: self._on_train_done,
            WEIGHTS_SYNCED: self._on_weights_synced,
            MOVE_RELEASE: self._on_move_release,
            MOVE_READY: self._on_move_ready,
            PHASE: self._on_phase,
            PLACEMENT: self._on_placement,
            TICK: self._on_tick,
        }
        while self.trainer_version < len(self.batches):
            if not self._heap:
                raise SimulationStalled("no events left before the last iteration finished")
            at, _, _, kind, payload = heapq.heappop(self._heap)
            self.now = at
            handlers[kind](payload)
            if self.options.check_invariants:
                self.check_invariants()
            if self.now - self._last_progress > self.options.stall_s:
                raise SimulationStalled(
                    f"nothing progressed for {self.options.stall_s:.0f}s of virtual time at t={self.now:.0f}s "
                    f"(allocation {self.allocation()})"
                )
        return self._result(time.perf_counter() - wall_start)

    # == GPU ownership ==========================================================================

    def allocation(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for owner in self.owner.values():
            counts[owner or "free"] = counts.get(owner or "free", 0) + 1
        return dict(sorted(counts.items()))

    def _workers_of(self, group: str) -> list[tuple[str, tuple[Device, ...]]]:
        if group == ROLLOUT:
            return [(e.worker_id, e.devices) for e in self.engines.values()]
        if group == INFERENCE:
            return [(w.id, w.devices) for w in self.logprob.workers]
        if group == ACTOR:
            return [(w.id, w.devices) for w in self.trainer.workers]
        return []

    def check_invariants(self) -> None:
        """Every GPU has exactly one owner (a group, a move in transit, or the free pool), and a
        group's workers hold exactly the GPUs it owns."""
        self.invariant_checks += 1
        if set(self.owner) != set(self.device_by_id):
            raise AssertionError("the ownership ledger lost or invented a device")
        held: dict[str, str] = {}
        for group in GPU_GROUPS:
            for worker_id, devices in self._workers_of(group):
                for device in devices:
                    if device.id in held:
                        raise AssertionError(f"{device.id} is in {held[device.id]} and in {worker_id}")
                    held[device.id] = group
        for device_id, owner in self.owner.items():
            if owner in GPU_GROUPS and held.get(device_id) != owner:
                raise AssertionError(f"{device_id} is owned by {owner} but none of its workers holds it")
            if owner not in GPU_GROUPS and device_id in held:
                raise AssertionError(f"{device_id} is held by {held[device_id]} but owned by {owner!r}")

    def _chunk(self, group: str, device_ids: Sequence[str]) -> tuple[list[tuple[Device, ...]], list[str]]:
        """Whole workers (tp * pp devices on one node) and the devices left over."""
        size = self._gpus_per_worker(group)
        by_node: dict[str, list[Device]] = {}
        for device_id in sorted(
            device_ids, key=lambda d: (self.device_by_id[d].node, self.device_by_id[d].index)
        ):
            device = self.device_by_id[device_id]
            by_node.setdefault(device.node, []).append(device)
        workers: list[tuple[Device, ...]] = []
        left: list[str] = []
        for node_devices in by_node.values():
            whole = len(node_devices) - len(node_devices) % size
            workers.extend(tuple(node_devices[i : i + size]) for i in range(0, whole, size))
            left.extend(d.id for d in node_devices[whole:])
        return workers, left

    def _add_workers(self, group: str, device_ids: Sequence[str], now: float, *, shed: bool = False) -> None:
        """Start ``group``'s workers on ``device_ids``. ``shed``: a migration grows the rollout,
        and its engines give the new ones their share of what they have running, as the real
        driver's ``shed_requests`` step does (agents/backends/ray/driver.py)."""
        before = list(self.engines.values()) if group == ROLLOUT and shed else []
        workers, left = self._chunk(group, device_ids)
        for device_id in left:
            self.owner[device_id] = FREE
        for devices in workers:
            for device in devices:
                self.owner[device.id] = group
            worker_id = self._new_id(group)
            if group == ROLLOUT:
                self._add_engine(worker_id, devices, now)
            elif group == INFERENCE:
                self.logprob.add_worker(worker_id, devices)
            else:
                self.trainer.change(now, add=[TrainerWorker(worker_id, devices)])
            self._marks[worker_id] = SampleMark(now)
        self._group_changed_at[group] = now
        if group == ROLLOUT:
            self.router.set_workers(self.engines)
            joined = [e for e in self.engines.values() if e not in before]
            if before and joined:
                self._shed_to(before, joined, now)
            self._dispatch(list(self.engines.values()), now)
        elif group == INFERENCE:
            self._start_logprob(now)
        else:
            self._kick_trainer(now)

    def _shed_to(self, old: Sequence[Engine], joined: Sequence[Engine], now: float) -> None:
        """The new engines' share (their part of the grown group) of the rollout's requests:
        first what waits, in the router or on an old engine not yet admitted (the real driver
        sheds the latest begun calls first, which sit queued in their engine); then, for what
        that leaves short, the old engines abort running requests, which resume with their
        partial output as context on the new engines."""
        share = len(joined) / (len(old) + len(joined))
        running = sum(e.batch for e in old)
        waiting = len(self.router) + sum(len(e.local) for e in old)
        short = round(share * (running + waiting)) - waiting
        shed: list[SimRequest] = []
        for engine in old:
            shed.extend(engine.take_queued(round(share * len(engine.local))))
            if short > 0 and running:
                finished, aborted = engine.shed(now, round(short * engine.batch / running))
                for request in finished:
                    self._turn_done(engine, request, now)
                shed.extend(aborted)
                self._reschedule_engine(engine)
        if shed:
            self.router.take_back(self._routed(r) for r in shed)
        self._dispatch(joined, now)

    def _add_engine(self, worker_id: str, devices: tuple[Device, ...], now: float) -> None:
        hardware = HARDWARE[devices[0].hardware]
        coeffs = self.perf.engine_coeffs(hardware, colocated=self.colocated)
        self.engines[worker_id] = Engine(
            worker_id,
            devices,
            coeffs,
            max_running=self.workload.max_running_requests,
            peak_tokens_per_s=self.perf.engine_peak_tokens_per_s(
                coeffs, self.workload.max_running_requests, self.typical_context, self.workload.max_new_tokens
            ),
            kv_reserve_ratio=self.workload.perf.kv_reserve_ratio,
            now=now,
        )

    def _remove_workers(
        self, group: str, device_ids: set[str], now: float
    ) -> tuple[list[str], list[SimRequest]]:
        """Stop every worker of ``group`` holding one of ``device_ids``; returns (all devices those
        workers held, requests taken back)."""
        released: list[str] = []
        taken: list[SimRequest] = []
        if group == ROLLOUT:
            for worker_id in [
                w for w, e in self.engines.items() if any(d.id in device_ids for d in e.devices)
            ]:
                engine = self.engines.pop(worker_id)
                self._retire(engine)
                finished, back = engine.take_back_all(now)
                for request in finished:
                    self._turn_done(engine, request, now)
                taken.extend(back)
                released.extend(d.id for d in engine.devices)
                self.aggregator.forget_worker(worker_id)
            self.router.set_workers(self.engines)
        elif group == INFERENCE:
            for logprob_worker in [
                w for w in self.logprob.workers if any(d.id in device_ids for d in w.devices)
            ]:
                self.logprob.remove_worker(logprob_worker, now)
                released.extend(d.id for d in logprob_worker.devices)
                self.aggregator.forget_worker(logprob_worker.id)
        else:
            leaving = [w for w in self.trainer.workers if any(d.id in device_ids for d in w.devices)]
            self.trainer.change(now, remove=leaving)
            for worker in leaving:
                released.extend(d.id for d in worker.devices)
                self.aggregator.forget_worker(worker.id)
            self._reschedule_trainer()
        self._group_changed_at[group] = now
        return released, taken

    def _retire(self, engine: Engine) -> None:
        self.retired_retractions += engine.retractions
        self.retired_reprefilled += engine.reprefilled_tokens

    def _group_worker_count(self, group: str) -> int:
        return len(self._workers_of(group))

    # == colocated phases =======================================================================

    def _assign_all(self, group: str, now: float) -> None:
        self._add_workers(group, [d.id for d in self.devices], now)
        self.phase = group

    def _switch_phase(self, to: str, now: float, cost_s: float) -> None:
        """Take every GPU from the current stage and give it to ``to`` after ``cost_s``."""
        held = {d for d, owner in self.owner.items() if owner == self.phase}
        released, taken = self._remove_workers(self.phase, held, now)
        if taken:
            raise AssertionError("a colocated stage switched with requests still running")
        for device_id in released:
            self.owner[device_id] = "~phase"
        self.colocate_switch_s += cost_s
        self.phase = "~" + to
        self._push(now + cost_s, PHASE, to)

    def _on_phase(self, group: str) -> None:
        if group == ROLLOUT:
            self.rollout_version = self.trainer_version
        self._assign_all(group, self.now)
        if group == ROLLOUT:
            self._submit_allowed_batches(self.now)
        self._after_stage_progress()

    def _after_stage_progress(self) -> None:
        """Colocated: move to the next stage once the current one has nothing left this iteration."""
        if not self.colocated or self.trainer_version >= len(self.batches):
            return
        batch = self.batches[self.trainer_version]
        if self.phase == ROLLOUT and batch.submitted and batch.rollout_left == 0:
            target = INFERENCE if self.workload.log_prob_group else ACTOR
            self._switch_phase(target, self.now, self._stage_switch_s(ROLLOUT, target))
        elif self.phase == INFERENCE and batch.prompts_left == 0:
            # Log-probs and training run in the same trainer process: no offload in between.
            self._switch_phase(ACTOR, self.now, self._stage_switch_s(INFERENCE, ACTOR))

    def _stage_switch_s(self, before: str, after: str) -> float:
        return stage_switch_s(self.perf, self.workload.gpus, before, after)

    # == rollout ================================================================================

    def _submit_allowed_batches(self, now: float) -> None:
        """Submit every iteration whose data may be generated with the engines' weights: batch b
        needs weights of version b - staleness or newer (synchronous: exactly b)."""
        for b, batch in enumerate(self.batches):
            if batch.submitted:
                continue
            if self.rollout_version < b - self.staleness or (self.colocated and self.phase != ROLLOUT):
                break
            batch.submitted = True
            batch.submitted_at = now
            for idx in batch.episodes:
                self._submit_turn(self.episodes[idx], now)
        self._dispatch(list(self.engines.values()), now)

    def _submit_turn(self, episode: BatchEpisode, now: float) -> None:
        self._ids += 1
        request = episode.request(self._ids, episode.idx, now, max_new=self.workload.max_new_tokens)
        self.router.submit(self._routed(request))

    def _routed(self, request: SimRequest) -> RoutedRequest:
        return RoutedRequest(
            request_id=str(request.rid),
            episode_id=str(request.episode),
            completed_tool_calls=request.completed_tool_calls,
            prefix_tokens=request.context,
            enqueued_at=request.enqueued_at,
            payload=request,
        )

    def _dispatch(self, engines: Sequence[Engine], now: float) -> None:
        """Admit work round-robin, one request per engine per round, least loaded engine first,
        so a burst of submissions spreads over the engines as a load-balancing router would.
        An engine is only brought to ``now`` when it admits something: checking costs nothing."""
        if not len(self.router) and not any(e.local for e in engines):
            return
        pending = sorted(
            (e for e in engines if e.worker_id in self.engines and e.batch < e.max_running),
            key=lambda e: (e.batch + len(e.local), e.worker_id),
        )
        touched: dict[str, Engine] = {}
        while pending:
            still = []
            for engine in pending:
                request = self._next_request(engine, now)
                if request is None:
                    continue
                touched[engine.worker_id] = engine
                episode = self.episodes[request.episode]
                if episode.version < 0:
                    episode.version = self.rollout_version
                engine.add(request, now)
                if engine.batch < engine.max_running:
                    still.append(engine)
            pending = still
        for engine in touched.values():
            engine.flush(now)
            self._reschedule_engine(engine)

    def _next_request(self, engine: Engine, now: float) -> SimRequest | None:
        if engine.local:
            if engine.fits(engine.local[0], now):
                return engine.local.popleft()
            return None
        routed = self.router.next_for_worker(engine.worker_id, now, self.engine_loads)
        if routed is None:
            return None
        request: SimRequest = routed.payload
        if engine.fits(request, now):
            return request
        engine.local.append(request)  # dispatched here; waits in the engine's own queue
        return None

    def _reschedule_engine(self, engine: Engine) -> None:
        upcoming = engine.next_event()
        if upcoming is not None:
            self._push(upcoming[0], ENGINE, (engine, engine.epoch, upcoming[1]))

    def _on_engine(self, payload: tuple[Engine, int, int]) -> None:
        engine, epoch, step = payload
        if epoch != engine.epoch or self.engines.get(engine.worker_id) is not engine:
            return
        engine.advance_to_step(step)
        finished = engine.pop_finished()
        engine.retract_if_full()
        for request in finished:
            self._turn_done(engine, request, self.now)
        self._dispatch([engine], self.now)
        self._reschedule_engine(engine)
        self._after_stage_progress()

    def _turn_done(self, engine: Engine, request: SimRequest, now: float) -> None:
        self._last_progress = now
        episode = self.episodes[request.episode]
        record = episode.record
        episode.context = request.context
        self.generated_tokens += episode.response_tokens
        self.router.note_turn_length(episode.turn, episode.response_tokens)
        if episode.has_next_turn:
            engine.cache_episode(episode.idx, episode.context)
            assert self.tool is not None
            for started in self.tool.submit(episode.idx, episode.tool_latency_s, now):
                self._push(started[0], CPU_DONE, (self.tool, started[1], started[2]))
            return
        self.router.forget_episode(str(episode.idx))
        episode.rollout_done_at = now
        self.batches[episode.batch].rollout_left -= 1
        for started in self.reward.submit(episode.idx, record.reward_latency_s, now):
            self._push(started[0], CPU_DONE, (self.reward, started[1], started[2]))

    # == CPU stages =============================================================================

    def _on_cpu_done(self, payload: tuple[CpuPool, CpuWorker, int]) -> None:
        pool, worker, idx = payload
        for started in pool.finish(worker, self.now):
            self._push(started[0], CPU_DONE, (pool, started[1], started[2]))
        episode = self.episodes[idx]
        if pool is self.tool:
            # The tool's output joins the context; the next turn asks for the engine holding the cache.
            episode.tool_done()
            self._submit_turn(episode, self.now)
            self._dispatch(list(self.engines.values()), self.now)
            return
        self.batches[episode.batch].rewarded += 1
        if self.workload.log_prob_group:
            self.logprob.submit(idx, episode.record.total_tokens)
            self._start_logprob(self.now)
        else:
            self._sample_ready(episode)

    # == log-probs ==============================================================================

    def _start_logprob(self, now: float) -> None:
        for worker in self.logprob.start_idle(now):
            self._push(worker.ends_at, LOGPROB_DONE, (worker, worker.epoch))

    def _on_logprob_done(self, payload: tuple[LogProbWorker, int]) -> None:
        worker, epoch = payload
        if epoch != worker.epoch or worker not in self.logprob.workers:
            return
        for idx in self.logprob.finish(worker, self.now):
            self._sample_ready(self.episodes[idx])
        self._start_logprob(self.now)
        self._after_stage_progress()

    def _sample_ready(self, episode: BatchEpisode) -> None:
        """A sample has its reward and log-probs; a prompt's group complete joins a mini-batch."""
        self._last_progress = self.now
        batch = self.batches[episode.batch]
        prompt = episode.record.prompt_id
        batch.prompt_remaining[prompt] -= 1
        if batch.prompt_remaining[prompt]:
            return
        batch.ready_prompts.append(prompt)
        batch.prompts_left -= 1
        size = self.workload.prompts_per_minibatch
        while len(batch.ready_prompts) >= size or (batch.prompts_left == 0 and batch.ready_prompts):
            prompts = set(batch.ready_prompts[:size])
            del batch.ready_prompts[:size]
            episodes = tuple(i for i in batch.episodes if self.episodes[i].record.prompt_id in prompts)
            lengths = [self.episodes[i].record.total_tokens for i in episodes]
            self.trainer.offer(
                MiniBatch(
                    batch=episode.batch,
                    index=batch.minibatches_formed,
                    episodes=episodes,
                    tokens=sum(lengths),
                    flops=self.perf.train_flops(lengths),
                )
            )
            batch.minibatches_formed += 1
        self._kick_trainer(self.now)

    # == trainer ================================================================================

    def _kick_trainer(self, now: float) -> None:
        if self.trainer.start_next(now):
            minibatch = self.trainer.current
            assert minibatch is not None
            for idx in minibatch.episodes:
                self.staleness_seen.append(self.trainer_version - self.episodes[idx].version)
        self._reschedule_trainer()

    def _reschedule_trainer(self) -> None:
        end = self.trainer.end_time()
        if end is not None:
            self._push(max(end, self.now), TRAIN_DONE, self.trainer.epoch)

    def _on_train_done(self, epoch: int) -> None:
        if epoch != self.trainer.epoch:
            return
        minibatch = self.trainer.finish(self.now)
        self._last_progress = self.now
        self.tokens_trained += minibatch.tokens
        batch = self.batches[minibatch.batch]
        if self.trainer.trained_in_batch < batch.minibatches_total:
            self._kick_trainer(self.now)
            return
        # The iteration is trained: new weights, the policy's end-of-iteration moves, the next batch.
        batch.trained_at = self.now
        self.placements.append(self._placement_now())
        self.iteration_end_s.append(self.now)
        self.trainer_version += 1
        self.trainer.next_batch += 1
        self.trainer.trained_in_batch = 0
        if self.trainer_version >= len(self.batches):
            return
        graph = self.graph(self.now)
        for decision in self.policy.on_iteration_end(graph, self.now):
            self.decisions_issued += 1
            self._apply(decision, self.now)
        change = self.policy.next_placement()
        if change is not None and change.placement.value != self._placement_now():
            problem = self._placement_problem(change.placement)
            if problem is None:
                self._pending_placement = change
                self._change_placement_when_idle(self.now)
                return
            self.rejected.append((self.now, "replan_placement", problem))
            self.policy.placement_refused(change, problem)
        if self.colocated:
            self._switch_phase(ROLLOUT, self.now, self._stage_switch_s(ACTOR, ROLLOUT))
            return
        sync_s = self.perf.weight_sync_s()
        for engine in self.engines.values():
            engine.pause(self.now, sync_s)
            self._reschedule_engine(engine)
        self._push(self.now + sync_s, WEIGHTS_SYNCED, self.trainer_version)
        self._kick_trainer(self.now)

    # == placement changes (a re-planning policy) ===============================================

    def _placement_now(self) -> str:
        return (Placement.COLOCATED if self.colocated else Placement.DISAGGREGATED).value

    def _placement_problem(self, to: Placement) -> str | None:
        """Why the job cannot switch to ``to`` at this boundary, or None."""
        if any(b.submitted for b in self.batches[self.trainer_version :]):
            return "a later batch is already being generated (asynchronous RL keeps its placement)"
        if to is Placement.COLOCATED:
            for hardware in sorted({d.hardware for d in self.devices}):
                coeffs = self.perf.engine_coeffs(HARDWARE[hardware], colocated=True)
                if coeffs.kv_capacity_tokens < self._longest_context:
                    return f"a colocated engine on {hardware} cannot hold the longest episode"
        return None

    def _change_placement_when_idle(self, now: float) -> None:
        """Start the pending placement change once no migration is in flight."""
        change = self._pending_placement
        if change is None or self.moves:
            return
        self._pending_placement = None
        to = change.placement
        total = len(self.devices)
        trainer_before = sum(1 for owner in self.owner.values() if owner == ACTOR)
        for group in self._gpu_groups():
            held = {d for d, owner in self.owner.items() if owner == group}
            if held:
                _, taken = self._remove_workers(group, held, now)
                if taken:
                    raise AssertionError("a placement change stopped engines with requests running")
        for device in self.devices:
            self.owner[device.id] = REPLACING
        split: dict[str, int] | None = None
        if to is Placement.COLOCATED:
            # The trainer's state spreads from its ranks to every GPU; every GPU starts an engine.
            moved, after = max(1, total - trainer_before), total
        else:
            split = self._initial_split()
            moved, after = max(1, total - split[ACTOR]), split[ACTOR]
        cost_s = (
            self.cost_model.estimate_s(MigrationStrategy.P2P, gpus_moved=moved, recipient_gpus_after=after)
            + self.cost_model.engine_launch_s()
        )
        self.placement_changes.append((now, self.trainer_version, to.value, cost_s, change.detail))
        self._push(now + cost_s, PLACEMENT, (to, split))

    def _on_placement(self, payload: tuple[Placement, dict[str, int] | None]) -> None:
        to, split = payload
        if to is Placement.COLOCATED:
            self.colocated = True
            self.staleness = 0
            self._on_phase(ROLLOUT)
            return
        assert split is not None
        self.colocated = False
        self.staleness = self.workload.staleness or 0
        self.phase = ROLLOUT
        cursor = 0
        for group in self._gpu_groups():
            gpus = split[group]
            self._add_workers(group, tuple(d.id for d in self.devices[cursor : cursor + gpus]), self.now)
            cursor += gpus
        self.rollout_version = self.trainer_version
        self._submit_allowed_batches(self.now)

    def _on_weights_synced(self, version: int) -> None:
        self.rollout_version = max(self.rollout_version, version)
        self._submit_allowed_batches(self.now)

    # == decisions and migrations ===============================================================

    def _decision_problem(self, decision: Decision) -> str | None:
        if self.colocated:
            return "colocated placement: every stage time-shares all GPUs, nothing can move"
        if decision.donor is None and decision.recipient is None:
            return "neither a donor nor a recipient"
        if not decision.device_ids:
            return "no devices"
        if len(set(decision.device_ids)) != len(decision.device_ids):
            return "a device is listed twice"
        for group in (decision.donor, decision.recipient):
            if group is not None and group not in self._gpu_groups():
                kind = (
                    "runs on CPUs in this job"
                    if group in (REWARD, TOOL)
                    else "is not a GPU group of this job"
                )
                return f"group {group!r} {kind}"
        if decision.donor == decision.recipient:
            return "donor and recipient are the same group"
        expected = decision.donor or FREE
        for device_id in decision.device_ids:
            owner = self.owner.get(device_id)
            if owner is None:
                return f"unknown device {device_id}"
            if owner != expected:
                return f"{device_id} belongs to {owner or 'the free pool'}, not {expected or 'the free pool'}"
        if decision.donor is not None:
            moved = set(decision.device_ids)
            affected = sum(
                1 for _, devices in self._workers_of(decision.donor) if any(d.id in moved for d in devices)
            )
            if self._group_worker_count(decision.donor) - affected < 1:
                return self._emptying_problem(decision.donor)
        return None

    def _emptying_problem(self, group: str) -> str | None:
        """Why ``group`` may not give up its last worker, or None. Only a synchronous job's
        rollout or log-prob group that has done its share of the current iteration may (RLinf
        releases the rollout instances no longer needed, ceil(running / max_running_requests),
        none once nothing runs): nothing comes to it before the iteration ends, and the policy's
        iteration-end returns bring its GPUs back before the next batch. The trainer holds the
        model's state; an asynchronous job's next batch may arrive at any time."""
        left = f"{group} would be left without workers"
        if group not in (ROLLOUT, INFERENCE):
            return left
        if self.staleness != 0:
            return f"{left} (an asynchronous job's groups keep one)"
        if not self._may_empty(group):
            return f"{left} while it has work this iteration"
        return None

    def _may_empty(self, group: str) -> bool:
        """Whether a synchronous job's ``group`` is done with the current iteration's work."""
        if self.trainer_version >= len(self.batches):
            return False
        batch = self.batches[self.trainer_version]
        if group == ROLLOUT:
            return (
                batch.submitted
                and batch.rollout_left == 0
                and not len(self.router)
                and all(e.batch == 0 and not e.local for e in self.engines.values())
            )
        if group == INFERENCE:
            return (
                batch.prompts_left == 0
                and self.logprob.queued_tokens == 0
                and not any(w.batch for w in self.logprob.workers)
            )
        return False

    def _apply(self, decision: Decision, now: float) -> None:
        problem = self._decision_problem(decision)
        if problem is not None:
            self.rejected.append((now, decision.reason.value, problem))
            self.policy.decision_refused(decision, problem)
            return
        self._ids += 1
        move = Move(
            id=self._ids, decision=decision, devices=decision.device_ids, started_at=now, donor_cost_s=0.0
        )
        transit = f"~move{move.id}"
        devices = set(decision.device_ids)
        if decision.donor is not None:
            donor = decision.donor
            released, taken = self._remove_workers(donor, devices, now)
            for device_id in released:
                # Devices of a stopped worker that the decision did not name go to the free pool.
                self.owner[device_id] = transit if device_id in devices else FREE
            move.taken_back = taken
            strategy = decision.donor_strategy or self._strategy(donor)
            remaining = sum(len(d) for _, d in self._workers_of(donor))
            move.donor_cost_s = self.cost_model.estimate_s(
                strategy,
                gpus_moved=len(devices),
                recipient_gpus_after=max(remaining, 1),
                requests_taken_back=len(taken),
            )
            if donor == ACTOR:
                self.trainer.pause(now, move.donor_cost_s)
                self._reschedule_trainer()
        else:
            for device_id in devices:
                self.owner[device_id] = transit
        self.moves[move.id] = move
        self._push(now + move.donor_cost_s, MOVE_RELEASE, move.id)

    def _strategy(self, group: str) -> MigrationStrategy:
        return {ROLLOUT: MigrationStrategy.WORKLOAD, INFERENCE: MigrationStrategy.WORKLOAD}.get(
            group, MigrationStrategy.P2P
        )

    def _on_move_release(self, move_id: int) -> None:
        move = self.moves[move_id]
        move.released_at = self.now
        if move.taken_back:
            # Partial output becomes the new prompt; the remaining engines re-prefill it.
            self.router.take_back(self._routed(r) for r in move.taken_back)
            self._dispatch(list(self.engines.values()), self.now)
        recipient = move.decision.recipient
        if recipient is None:
            for device_id in move.devices:
                self.owner[device_id] = FREE
            self._finish_move(move)
            return
        strategy = move.decision.recipient_strategy or self._strategy(recipient)
        if strategy is MigrationStrategy.WORKLOAD:
            move.recipient_cost_s = self.cost_model.engine_launch_s()
        else:
            after = sum(len(d) for _, d in self._workers_of(recipient)) + len(move.devices)
            move.recipient_cost_s = self.cost_model.estimate_s(
                strategy, gpus_moved=len(move.devices), recipient_gpus_after=after
            )
        if recipient == ACTOR:
            # p2p: the old ranks stop at a micro-batch boundary while the new ranks receive state.
            self.trainer.pause(self.now, move.recipient_cost_s)
            self._reschedule_trainer()
        self._push(self.now + move.recipient_cost_s, MOVE_READY, move.id)

    def _on_move_ready(self, move_id: int) -> None:
        move = self.moves[move_id]
        recipient = move.decision.recipient
        assert recipient is not None
        self._add_workers(recipient, move.devices, self.now, shed=True)
        self._finish_move(move)

    def _finish_move(self, move: Move) -> None:
        move.ready_at = self.now
        self.move_records.append(
            MoveRecord(
                at=move.started_at,
                reason=move.decision.reason.value,
                donor=move.decision.donor,
                recipient=move.decision.recipient,
                gpus=len(move.devices),
                donor_cost_s=move.donor_cost_s,
                recipient_cost_s=move.recipient_cost_s,
                requests_taken_back=len(move.taken_back),
                iteration=self.trainer_version,
            )
        )
        del self.moves[move.id]
        if self._pending_placement is not None:
            self._change_placement_when_idle(self.now)

    # == telemetry, the policy tick =============================================================

    def _on_tick(self, _: Any) -> None:
        now = self.now
        progress = self._progress()
        self._sample_engines(now, progress[ROLLOUT])
        self._sample_logprob(now, progress[INFERENCE])
        self._sample_trainer(now, progress[ACTOR])
        self._sample_cpu(self.reward, now, progress[REWARD])
        if self.tool is not None:
            self._sample_cpu(self.tool, now, progress[TOOL])
        self._account_gpu_time()
        graph = self.graph(now)
        limits = {ROLLOUT: self.workload.max_running_requests, INFERENCE: 1, ACTOR: 1}
        if self.tool is not None:
            limits[TOOL] = self.workload.tool_slots
        limits[REWARD] = self.workload.reward_slots
        signals = self.aggregator.all_signals(graph, now, max_in_flight_per_worker=limits)
        self._observe(graph, signals, now)
        free = [self.device_by_id[d] for d, owner in self.owner.items() if owner == FREE]
        started = time.perf_counter()
        decisions = self.policy.decide(graph, signals, free, now)
        self.decision_latencies_s.append(time.perf_counter() - started)
        for decision in decisions:
            self.decisions_issued += 1
            self._apply(decision, now)
        # Re-offer work that waits for an affinity that has expired.
        self._dispatch(list(self.engines.values()), now)
        self._push(now + self.options.tick_s, TICK, None)

    def _account_gpu_time(self) -> None:
        """Charge the tick's GPU-seconds to what each GPU did since the last tick, from the
        utilisation just sampled (useful work relative to a full worker) and who holds it now."""
        iteration = min(self.trainer_version, len(self.batches) - 1)
        while len(self.gpu_time) <= iteration:
            self.gpu_time.append(dict.fromkeys(GPU_TIME_KINDS, 0.0))
        spent = self.gpu_time[iteration]
        dt = self.options.tick_s
        engine_gpus = self._gpus_per_worker(ROLLOUT) * dt
        for engine in self.engines.values():
            if engine.batch == 0 and not engine.local:
                spent["rollout_empty"] += engine_gpus
                continue
            used = self._utilisation(engine.worker_id)
            spent["rollout_decoding"] += engine_gpus * used
            spent["rollout_partly_idle"] += engine_gpus * (1.0 - used)
        for group, workers, busy, idle in (
            (INFERENCE, [w.id for w in self.logprob.workers], "log_prob_busy", "log_prob_idle"),
            (ACTOR, [w.id for w in self.trainer.workers], "trainer_busy", "trainer_idle"),
        ):
            gpus = self._gpus_per_worker(group) * dt
            for worker_id in workers:
                used = self._utilisation(worker_id)
                spent[busy] += gpus * used
                spent[idle] += gpus * (1.0 - used)
        for owner in self.owner.values():
            if owner == FREE:
                spent["free"] += dt
            elif owner == "~phase":
                spent["colocated_switch"] += dt
            elif owner.startswith("~move"):
                spent["in_migration"] += dt

    def _progress(self) -> dict[str, float]:
        """Per group, the share of the current iteration's work done (the oldest iteration still
        generating, for the rollout of an async job that generates ahead)."""
        batch = self.batches[min(self.trainer_version, len(self.batches) - 1)]
        rolling = next((x for x in self.batches if x.submitted and x.rollout_left > 0), batch)
        episodes = len(rolling.episodes)
        rolled = (episodes - rolling.rollout_left) / episodes
        prompts = len(batch.prompt_remaining)
        return {
            ROLLOUT: rolled,
            TOOL: rolled,
            REWARD: batch.rewarded / len(batch.episodes),
            INFERENCE: (prompts - batch.prompts_left) / prompts,
            ACTOR: self.trainer.trained_in_batch / batch.minibatches_total,
        }

    def _sample(
        self,
        group: str,
        worker_id: str,
        now: float,
        *,
        tokens: float,
        work: float,
        capacity: float = 1.0,
        queue_length: int,
        in_flight: int,
        progress: float,
    ) -> None:
        """One WorkerSample from cumulative counters: ``work`` (busy seconds, or useful work in
        seconds of a full worker) over the elapsed time times ``capacity`` is the utilisation."""
        mark = self._marks.get(worker_id)
        if mark is None:
            mark = self._marks[worker_id] = SampleMark(now, tokens, work)
        utilisation, new_tokens = mark.take(now, tokens, work, capacity)
        self.aggregator.add(
            WorkerSample(
                group_id=group,
                worker_id=worker_id,
                at=now,
                utilisation=utilisation,
                queue_length=queue_length,
                in_flight=in_flight,
                tokens=new_tokens,
                progress=progress,
            )
        )

    def _utilisation(self, worker_id: str) -> float:
        """The worker's utilisation at its last sample (0 before any)."""
        mark = self._marks.get(worker_id)
        return mark.utilisation if mark is not None else 0.0

    def _sample_engines(self, now: float, progress: float) -> None:
        engines = list(self.engines.values())
        share, extra = divmod(len(self.router), len(engines)) if engines else (0, 0)
        for position, engine in enumerate(engines):
            decoded = engine.decoded_at(now)
            # Useful work relative to a full engine: decode tokens at its peak rate, plus prefill time.
            work = decoded / engine.peak_tokens_per_s + engine.prefill_busy_at(now)
            self._sample(
                ROLLOUT,
                engine.worker_id,
                now,
                tokens=decoded,
                work=work,
                queue_length=len(engine.local) + share + (1 if position < extra else 0),
                in_flight=engine.batch,
                progress=progress,
            )

    def _sample_logprob(self, now: float, progress: float) -> None:
        workers = self.logprob.workers
        queued = math.ceil(self.logprob.queued_tokens / self.logprob.micro_batch_tokens)
        share, extra = divmod(queued, len(workers)) if workers else (0, 0)
        for position, worker in enumerate(workers):
            self._sample(
                INFERENCE,
                worker.id,
                now,
                tokens=worker.tokens_at(now),
                work=worker.busy_at(now),
                queue_length=share + (1 if position < extra else 0),
                in_flight=1 if worker.batch else 0,
                progress=progress,
            )

    def _sample_trainer(self, now: float, progress: float) -> None:
        """The gang works as one: its tokens and busy time since the last tick are shared by the
        ranks that took part (ranks beyond the largest valid data-parallel size sit idle)."""
        active = self.trainer.active_workers()
        tokens = self.trainer.tokens_at(now)
        busy = self.trainer.busy_at(now)
        new_tokens = tokens - self._trainer_tokens_mark
        new_busy = busy - self._trainer_busy_mark
        self._trainer_tokens_mark, self._trainer_busy_mark = tokens, busy
        for worker in active:
            worker.tokens_done += new_tokens / len(active)
            worker.busy_s += new_busy
        running = self.trainer.current is not None and now >= self.trainer.paused_until
        queued = self.trainer.queued()
        for position, worker in enumerate(self.trainer.workers):
            self._sample(
                ACTOR,
                worker.id,
                now,
                tokens=worker.tokens_done,
                work=worker.busy_s,
                queue_length=queued if position == 0 else 0,
                in_flight=1 if running and position < len(active) else 0,
                progress=progress,
            )

    def _sample_cpu(self, pool: CpuPool, now: float, progress: float) -> None:
        share, extra = divmod(len(pool.queue), len(pool.workers))
        for position, worker in enumerate(pool.workers):
            self._sample(
                pool.group_id,
                worker.id,
                now,
                tokens=0.0,
                work=worker.busy_at(now),
                capacity=pool.slots,
                queue_length=share + (1 if position < extra else 0),
                in_flight=worker.active,
                progress=progress,
            )

    def _observe(self, graph: Hypergraph, signals: Mapping[str, GroupSignals], now: float) -> None:
        """Feed the predictor what a group delivered while its capacity, not its demand, bound it:
        a whole window with the same GPUs and work queued for it (or, for the trainer, busy)."""
        if self.observe is None:
            return
        for node in graph.nodes:
            if node.id not in GPU_GROUPS or node.gpus == 0:
                continue
            sig = signals.get(node.id)
            if sig is None or sig.tokens_per_s <= 0:
                continue
            if now - self._group_changed_at[node.id] < self.options.window_s:
                continue
            if now - self._last_observed.get(node.id, -math.inf) < self.options.observe_every_s:
                continue
            saturated = sig.utilisation_p50 >= 0.9 if node.id == ACTOR else sig.queue_length > 0
            if not saturated:
                continue
            self._last_observed[node.id] = now
            self.observe(node.id, node.kind, node.gpus, sig.tokens_per_s, now)

    # == the hypergraph =========================================================================

    def _node(self, group: str, workers: tuple[Worker, ...]) -> HyperNode:
        if group == ROLLOUT:
            return HyperNode(
                id=ROLLOUT,
                kind=ComponentKind.ROLLOUT,
                workers=workers,
                parallelism=Parallelism(tp=self.model.rollout_tp),
                # A synchronous job's rollout may give up every engine once its batch is done
                # (``_may_empty``); an asynchronous one keeps one for the next batch.
                min_workers=0 if self.staleness == 0 else 1,
            )
        if group == INFERENCE:
            return HyperNode(
                id=INFERENCE,
                kind=ComponentKind.INFERENCE,
                workers=workers,
                depends_on=(REWARD,),
                parallelism=Parallelism(tp=self.model.trainer_tp, pp=self.model.trainer_pp),
                min_workers=0 if self.staleness == 0 else 1,
            )
        return HyperNode(
            id=ACTOR,
            kind=ComponentKind.ACTOR,
            workers=workers,
            depends_on=(INFERENCE,) if self.workload.log_prob_group else (REWARD,),
            parallelism=Parallelism(
                tp=self.model.trainer_tp, pp=self.model.trainer_pp, valid_dp=self.workload.valid_trainer_dp
            ),
        )

    def _cpu_nodes(self) -> list[HyperNode]:
        pools = [self.reward] + ([self.tool] if self.tool is not None else [])
        return [
            self._cpu_node(
                pool.group_id,
                tuple(Worker(w.id, (), utilisation=self._utilisation(w.id)) for w in pool.workers),
            )
            for pool in pools
        ]

    def _cpu_node(self, group: str, workers: tuple[Worker, ...]) -> HyperNode:
        kind = ComponentKind.REWARD if group == REWARD else ComponentKind.TOOL
        return HyperNode(
            id=group, kind=kind, workers=workers, depends_on=(ROLLOUT,), min_workers=len(workers)
        )

    def graph(self, now: float) -> Hypergraph:
        nodes = []
        for group in self._gpu_groups():
            workers = tuple(
                Worker(worker_id, devices, utilisation=self._utilisation(worker_id))
                for worker_id, devices in self._workers_of(group)
            )
            nodes.append(self._node(group, workers))
        nodes.extend(self._cpu_nodes())
        b = min(self.trainer_version, len(self.batches) - 1)
        batch = self.batches[b]
        episodes = len(batch.episodes)
        rolled = episodes - batch.rollout_left
        prompts = len(batch.prompt_remaining)
        edges = [
            HyperEdge("rollout->reward", ROLLOUT, REWARD, episodes, rolled, rolled),
            HyperEdge(
                "reward->inference" if self.workload.log_prob_group else "reward->actor",
                REWARD,
                INFERENCE if self.workload.log_prob_group else ACTOR,
                episodes,
                rolled,
                rolled,
            ),
        ]
        if self.workload.log_prob_group:
            edges.append(
                HyperEdge(
                    "inference->actor",
                    INFERENCE,
                    ACTOR,
                    prompts,
                    prompts - batch.prompts_left,
                    min(prompts, self.trainer.trained_in_batch * self.workload.prompts_per_minibatch),
                )
            )
        if self.tool is not None:
            edges.append(HyperEdge("rollout->tool", ROLLOUT, TOOL, 0, self.tool.done, self.tool.done))
        return Hypergraph(
            job_id=self.workload.name,
            nodes=tuple(nodes),
            edges=tuple(edges),
            iteration=self.trainer_version,
            policy_version=self.trainer_version,
            taken_at=now,
        )

    # == results ================================================================================

    def _result(self, wall_s: float) -> SimResult:
        makespan = self.now
        total_gpus = self.workload.gpus
        migration_gpu_s = sum(r.gpus * (r.donor_cost_s + r.recipient_cost_s) for r in self.move_records)
        migration_gpu_s += self.trainer.pause_gpu_s
        reasons: dict[str, int] = {}
        for record in self.move_records:
            reasons[record.reason] = reasons.get(record.reason, 0) + 1
        rejected: dict[str, int] = {}
        for _, _, problem in self.rejected:
            rejected[problem] = rejected.get(problem, 0) + 1
        tails = []
        for batch in self.batches:
            times = sorted(self.episodes[i].rollout_done_at - batch.submitted_at for i in batch.episodes)
            last = times[-1]
            tails.append(sum(1 for t in times if t <= 0.6 * last) / len(times) if last > 0 else 1.0)
        stats = self.router.stats
        retractions = self.retired_retractions + sum(e.retractions for e in self.engines.values())
        reprefilled = self.retired_reprefilled + sum(e.reprefilled_tokens for e in self.engines.values())
        return SimResult(
            workload=self.workload.name,
            policy=self.policy.name,
            placement=self.policy.placement.value,
            gpus=total_gpus,
            iterations=len(self.batches),
            staleness_bound=self.staleness,
            router_mode=self.router_mode,
            initial_split=dict(self.initial_split),
            split_note=self.split_note,
            makespan_s=makespan,
            tokens=self.tokens_trained,
            generated_tokens=self.generated_tokens,
            tokens_per_s=self.tokens_trained / makespan if makespan > 0 else 0.0,
            iteration_end_s=tuple(self.iteration_end_s),
            migrations=len(self.move_records),
            moves_by_reason=dict(sorted(reasons.items())),
            moves=tuple(self.move_records),
            decisions=self.decisions_issued,
            rejected_by_problem=dict(sorted(rejected.items())),
            migration_gpu_s=migration_gpu_s,
            online_overhead=migration_gpu_s / (total_gpus * makespan) if makespan > 0 else 0.0,
            colocate_switch_s=self.colocate_switch_s,
            max_staleness=max(self.staleness_seen, default=0),
            mean_staleness=sum(self.staleness_seen) / len(self.staleness_seen)
            if self.staleness_seen
            else 0.0,
            retractions=retractions,
            reprefilled_tokens=reprefilled,
            affinity_hits=stats.affinity_hits,
            requests_dispatched=stats.dispatched,
            done_by_60pct_of_last=tuple(tails),
            gpu_seconds={kind: sum(it[kind] for it in self.gpu_time) for kind in GPU_TIME_KINDS},
            gpu_seconds_by_iteration=tuple(dict(it) for it in self.gpu_time),
            decision_latency_p50_ms=1e3 * percentile(self.decision_latencies_s, 0.5),
            decision_latency_p99_ms=1e3 * percentile(self.decision_latencies_s, 0.99),
            decision_calls=len(self.decision_latencies_s),
            wall_s=wall_s,
            placements=tuple(self.placements),
            placement_changes=tuple(
                PlacementChangeRecord(at, iteration, to, cost_s, why)
                for at, iteration, to, cost_s, why in self.placement_changes
            ),
        )
