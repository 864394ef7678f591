"""What the ``sim`` backend knows about one job, built from its launch payload.

The payload carries the normalised job spec (the JSON of ``jobs.spec.JobSpec.to_json()``); it is
read here as plain JSON so that the agent needs nothing of the control plane. From it come the
core simulator's workload (for the trace generator), the model (the nearest published architecture
of the core's table, with the spec's parameter count and the groups' parallelism), the performance
model and the migration cost model.

Every agent of a job derives the same work for iteration ``k`` from ``(seed, job id, k)`` alone, so
agents agree on it without talking to each other: the episodes (prompt and response lengths,
turns, tool latencies), the order in which downstream stages consume completed samples, and the
trainer's FLOPs.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agents.backends.sim.traces import TraceRefused, resolve_trace_path
from scheduler.core.costs import MigrationCostModel
from scheduler.core.sim.hardware import HARDWARE, MODELS, HardwareSpec, ModelSpec
from scheduler.core.sim.perf import EngineCoeffs, PerfModel
from scheduler.core.sim.stages import ACTOR, INFERENCE, REWARD, ROLLOUT, TOOL, stage_switch_s
from scheduler.core.sim.trace import (
    TraceRecord,
    decode_weighted_context,
    generate_trace,
    group_by_iteration,
    read_trace,
)
from scheduler.core.sim.workloads import AgenticTurns, Workload, WorkloadKind

GROUP_KINDS = (ROLLOUT, INFERENCE, REWARD, TOOL, ACTOR)
# Stages that process the iteration's samples one by one and report how many they completed.
ITEM_KINDS = (ROLLOUT, INFERENCE, REWARD, ACTOR)
# DAPO's recipe trains 32 prompts per mini-batch; each mini-batch ends with a gradient sync.
PROMPTS_PER_MINIBATCH = 32
REWARD_PASSES = 1  # a reward model's forward pass
MAX_RUNNING_REQUESTS = {WorkloadKind.MATH: 256, WorkloadKind.AGENTIC: 128}  # SGLang, per engine
TRACES_KEPT = 4  # iterations whose episodes stay in memory (current, staleness window, a spare)


class SpecProblem(ValueError):
    """The launch payload's spec cannot be simulated; the message names the field."""


@dataclass(frozen=True)
class GroupModel:
    name: str
    kind: str
    tp: int
    pp: int
    valid_dp: tuple[int, ...]
    depends_on: tuple[str, ...]

    @property
    def gpus_per_worker(self) -> int:
        return self.tp * self.pp


def _integer(data: Mapping[str, Any], key: str, path: str, default: int | None = None, low: int = 0) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpecProblem(f"{path}.{key}: must be an integer >= {low}, got {value!r}")
    return int(value)


def _number(data: Mapping[str, Any], key: str, path: str, default: float) -> float:
    value = data.get(key, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise SpecProblem(f"{path}.{key}: must be a number above 0, got {value!r}")
    return float(value)


def nearest_model(params_b: float) -> ModelSpec:
    """The core's published architecture closest in size (layers, hidden size, KV heads)."""
    return min(MODELS.values(), key=lambda m: (abs(math.log(m.params_b / params_b)), m.params_b))


class JobModel:
    """One job as the agent simulates it. A trace the spec names is read from under ``trace_dir``
    only (``traces.py``); without one, a spec naming a trace is refused."""

    def __init__(
        self,
        job_id: int,
        spec: Mapping[str, Any],
        *,
        seed: int = 0,
        trace_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(spec, Mapping):
            raise SpecProblem("spec: must be an object")
        self.job_id = job_id
        self.seed = seed
        model = spec.get("model")
        if not isinstance(model, Mapping):
            raise SpecProblem("spec.model: must be an object")
        self.params_b = _number(model, "params_b", "spec.model", 7.0)
        workload = spec.get("workload", {})
        if not isinstance(workload, Mapping):
            raise SpecProblem("spec.workload: must be an object")
        kind = workload.get("kind", "math")
        if kind not in (WorkloadKind.MATH.value, WorkloadKind.AGENTIC.value):
            raise SpecProblem(f"spec.workload.kind: must be 'math' or 'agentic', got {kind!r}")
        self.kind = WorkloadKind(kind)
        self.iterations = _integer(workload, "iterations", "spec.workload", 10, low=1)
        self.prompts = _integer(workload, "prompts_per_iteration", "spec.workload", 512, low=1)
        self.samples_per_prompt = _integer(workload, "samples_per_prompt", "spec.workload", 8, low=1)
        self.max_new_tokens = _integer(workload, "max_new_tokens", "spec.workload", 8192, low=1)
        staleness = workload.get("staleness", 0)
        self.staleness = 0 if staleness is None else _integer(workload, "staleness", "spec.workload", 0)
        self.trace_path = workload.get("trace")
        if self.trace_path is not None and not isinstance(self.trace_path, str):
            raise SpecProblem("spec.workload.trace: must be a path or null")
        turns = AgenticTurns()
        if self.kind is WorkloadKind.AGENTIC:
            max_turns = workload.get("max_turns")
            turns = replace(
                turns,
                max_turns=turns.max_turns
                if max_turns is None
                else _integer(workload, "max_turns", "spec.workload", low=1),
                tool_latency_median_s=_number(
                    workload, "tool_latency_s", "spec.workload", turns.tool_latency_median_s
                ),
            )
        self.groups = self._read_groups(spec.get("components"))
        self.gpus = self._count_gpus(spec["components"])
        base = nearest_model(self.params_b)
        actor = next((g for g in self.groups.values() if g.kind == ACTOR), None)
        self.model = replace(
            base,
            name=str(model.get("name", base.name)),
            params_b=self.params_b,
            trainer_tp=actor.tp if actor else base.trainer_tp,
            trainer_pp=actor.pp if actor else base.trainer_pp,
        )
        self.max_running = MAX_RUNNING_REQUESTS[self.kind]
        self.workload = Workload(
            name=f"job{job_id}",
            kind=self.kind,
            model=base.name,
            gpus=8,
            prompts_per_iteration=self.prompts,
            samples_per_prompt=self.samples_per_prompt,
            prompts_per_minibatch=self.prompts,
            max_new_tokens=self.max_new_tokens,
            iterations=1,
            max_running_requests=self.max_running,
            agentic=turns,
        )
        self.cost = MigrationCostModel(model_params_b=self.params_b)
        self._perf: dict[int, PerfModel] = {}
        self._coeffs: dict[tuple[int, str, bool], EngineCoeffs] = {}
        self._traces: OrderedDict[int, tuple[TraceRecord, ...]] = OrderedDict()
        self._orders: dict[int, tuple[int, ...]] = {}
        self._train_flops: dict[int, tuple[float, int]] = {}
        self._file_batches: list[list[TraceRecord]] | None = None
        if self.trace_path is not None:
            try:
                path = resolve_trace_path(self.trace_path, trace_dir)
            except TraceRefused as exc:
                raise SpecProblem(f"spec.workload.trace: {exc}") from exc
            try:
                records = read_trace(path)
            except (OSError, ValueError) as exc:  # a file of the trace directory: its problem may be told
                raise SpecProblem(f"spec.workload.trace: cannot read {self.trace_path!r}: {exc}") from exc
            self._file_batches = group_by_iteration(records, self.samples_per_iteration)
        self.typical_context = max(1.0, decode_weighted_context(self.records(0)))

    @staticmethod
    def _read_groups(components: Any) -> dict[str, GroupModel]:
        if not isinstance(components, list) or not components:
            raise SpecProblem("spec.components: must be a non-empty list")
        groups: dict[str, GroupModel] = {}
        for i, item in enumerate(components):
            path = f"spec.components[{i}]"
            if not isinstance(item, Mapping):
                raise SpecProblem(f"{path}: must be an object")
            name, kind = item.get("name"), item.get("kind")
            if not isinstance(name, str) or not name:
                raise SpecProblem(f"{path}.name: must be a non-empty string")
            if kind not in GROUP_KINDS:
                raise SpecProblem(f"{path}.kind: must be one of {', '.join(GROUP_KINDS)}")
            valid_dp = item.get("valid_dp") or ()
            depends_on = item.get("depends_on") or ()
            groups[name] = GroupModel(
                name=name,
                kind=kind,
                tp=_integer(item, "tp", path, 1, low=1),
                pp=_integer(item, "pp", path, 1, low=1),
                valid_dp=tuple(sorted(int(d) for d in valid_dp)),
                depends_on=tuple(str(d) for d in depends_on),
            )
        return groups

    @staticmethod
    def _count_gpus(components: Sequence[Mapping[str, Any]]) -> int:
        """The job's GPUs at start, as ``jobs.spec.JobSpec.total_gpus`` counts them: GPUs shared
        by colocated components once."""
        placed: set[int] = set()
        counted = 0
        for item in components:
            placement = item.get("placement")
            if isinstance(placement, list):
                placed.update(r for r in placement if isinstance(r, int))
            else:
                workers = item.get("workers")
                count = workers if isinstance(workers, int) and not isinstance(workers, bool) else 1
                counted += count * int(item.get("tp", 1)) * int(item.get("pp", 1))
        return max(1, len(placed) + counted)

    # -- shape -------------------------------------------------------------------------------

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def minibatches(self) -> int:
        return max(1, self.prompts // PROMPTS_PER_MINIBATCH)

    def group(self, name: str) -> GroupModel | None:
        return self.groups.get(name)

    def upstream(self, group: str) -> tuple[str, ...]:
        """The groups whose completed samples ``group`` consumes: its dependencies that process
        samples (tool sandboxes serve turns inside the rollout and are not a stage), or, when it
        names none, the rollout groups."""
        spec = self.groups[group]
        deps = tuple(d for d in spec.depends_on if d in self.groups and self.groups[d].kind in ITEM_KINDS)
        if deps:
            return deps
        return tuple(g.name for g in self.groups.values() if g.kind == ROLLOUT and g.name != group)

    # -- work of an iteration ----------------------------------------------------------------

    def records(self, iteration: int) -> tuple[TraceRecord, ...]:
        """The iteration's episodes, one per sample, the same on every agent."""
        cached = self._traces.get(iteration)
        if cached is not None:
            self._traces.move_to_end(iteration)
            return cached
        total = self.samples_per_iteration
        if self._file_batches:
            batch = self._file_batches[iteration % len(self._file_batches)]
            records = tuple(batch[i % len(batch)] for i in range(total))
        else:
            workload = replace(self.workload, name=f"job{self.job_id}-it{iteration}")
            records = tuple(generate_trace(workload, self.seed, iterations=1))
        self._traces[iteration] = records
        while len(self._traces) > TRACES_KEPT:
            evicted, _ = self._traces.popitem(last=False)
            self._orders.pop(evicted, None)
            self._train_flops.pop(evicted, None)
        return records

    def consumer_order(self, iteration: int) -> tuple[int, ...]:
        """Episode indices in the order downstream stages receive them: short responses finish
        their rollout first, so the n-th completed sample is taken to be the n-th shortest."""
        order = self._orders.get(iteration)
        if order is None:
            records = self.records(iteration)
            order = tuple(sorted(range(len(records)), key=lambda i: (records[i].generated_tokens, i)))
            self._orders[iteration] = order
        return order

    def consumed_record(self, iteration: int, position: int) -> TraceRecord:
        records = self.records(iteration)
        return records[self.consumer_order(iteration)[position % len(records)]]

    def training(self, iteration: int) -> tuple[float, int]:
        """(FLOPs, tokens) of training on the whole iteration."""
        cached = self._train_flops.get(iteration)
        if cached is None:
            lengths = [r.total_tokens for r in self.records(iteration)]
            cached = (self.perf(1).train_flops(lengths), sum(lengths))
            self._train_flops[iteration] = cached
        return cached

    # -- performance -------------------------------------------------------------------------

    def perf(self, tp: int) -> PerfModel:
        """The performance model with ``tp``-way tensor-parallel engines."""
        perf = self._perf.get(tp)
        if perf is None:
            perf = self._perf[tp] = PerfModel(replace(self.model, rollout_tp=tp), self.workload.perf)
        return perf

    def engine_coeffs(self, tp: int, hardware: HardwareSpec, *, colocated: bool = False) -> EngineCoeffs:
        """Raises SpecProblem when the model does not fit ``tp`` GPUs of this type. A colocated
        engine (time-sharing its GPUs with the trainer's stages) gets the smaller KV pool of the
        core's ``colocated_engine_mem_fraction``."""
        key = (tp, hardware.name, colocated)
        coeffs = self._coeffs.get(key)
        if coeffs is None:
            try:
                coeffs = self.perf(tp).engine_coeffs(hardware, colocated=colocated)
            except ValueError as exc:
                raise SpecProblem(f"an engine of this job does not fit: {exc}") from exc
            self._coeffs[key] = coeffs
        return coeffs

    def engine_peak_tokens_per_s(self, tp: int, coeffs: EngineCoeffs) -> float:
        return self.perf(tp).engine_peak_tokens_per_s(
            coeffs, self.max_running, self.typical_context, self.max_new_tokens
        )

    def rank_flops_per_s(self, hardware: Sequence[HardwareSpec]) -> float:
        """Training FLOP/s of one data-parallel rank (its ``tp * pp`` GPUs) at the trainer's MFU."""
        return self.perf(1).compute_rate(hardware)

    def weight_sync_s(self, tp: int) -> float:
        return self.perf(tp).weight_sync_s()

    def stage_switch_s(self, before: str, after: str) -> float:
        """A colocated switch between the stages of two group kinds, as the core simulator charges
        it for a job of this many GPUs (``stages.stage_switch_s``)."""
        return stage_switch_s(self.perf(1), self.gpus, before, after)


def hardware_spec(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        known = ", ".join(sorted(HARDWARE))
        raise SpecProblem(f"unknown hardware {name!r} (known: {known})") from None
