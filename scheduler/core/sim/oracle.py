"""An upper bound on the throughput any policy can reach on a trace and cluster.

Relaxations: GPUs are perfectly divisible between stages and moves are free; what is kept is the
work itself (at the best efficiency the performance model allows), the data dependencies and the
sequential decode of each request (a request's tokens come one step at a time). Per iteration
``b`` with ``G`` GPUs and staleness bound ``alpha`` (0 when synchronous):

    S_b = 0                               if b <= alpha
        = E_{b-alpha-1} + switch          otherwise (weights b-alpha must reach the engines)
    E_b = max( E_{b-1} + train_b / G,                 (training of b follows version b)
               S_b + work_b / G,                      (all of b's work after its start)
               S_b + critical_b,                      (its slowest sample, then its mini-batch)
               sum_{b' <= b} work_b' / G )            (everything trained by then was computed)

``work`` is GPU-seconds of decode, prefill, log-probs and training; ``critical`` is, over the
iteration's prompt groups, the longest sample's chain (first prefill, each turn decoded alone,
tool latencies, cached-prefix prefills, the verifier) plus its log-probs and the training of the
smallest mini-batch that can hold its group, on all ``G`` GPUs. The bound is ``tokens / E_last``.
docs/simulator.md derives each term and why the simulator can never beat it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.core.sim.hardware import HARDWARE, HardwareSpec
from scheduler.core.sim.perf import EngineCoeffs, PerfModel
from scheduler.core.sim.simulator import decode_alone_s
from scheduler.core.sim.stages import LOG_PROB_PASSES
from scheduler.core.sim.trace import TraceRecord, group_by_iteration
from scheduler.core.sim.workloads import Workload


@dataclass(frozen=True)
class OracleBound:
    tokens: int
    makespan_s: float  # a lower bound on any run's makespan
    tokens_per_s: float  # an upper bound on any run's throughput
    iteration_end_s: tuple[float, ...]
    work_gpu_s: tuple[float, ...]  # per iteration
    critical_path_s: tuple[float, ...]  # per iteration


@dataclass(frozen=True)
class _Best:
    """The most favourable constants over the cluster's hardware types."""

    coeffs: EngineCoeffs  # cheapest decode and prefill per GPU
    compute: HardwareSpec  # highest FLOP/s


def _best(workload: Workload, perf: PerfModel) -> _Best:
    types = sorted(set(workload.hardware_of_nodes()))
    specs = [HARDWARE[t] for t in types]
    all_coeffs = [perf.engine_coeffs(h) for h in specs]
    # Combine the cheapest of every term: a bound must hold whichever hardware a request lands on.
    base = all_coeffs[0]
    coeffs = EngineCoeffs(
        fixed_s=min(c.fixed_s for c in all_coeffs),
        weights_s=min(c.weights_s for c in all_coeffs),
        per_context_token_s=min(c.per_context_token_s for c in all_coeffs),
        per_sequence_s=min(c.per_sequence_s for c in all_coeffs),
        prefill_s_per_flop=min(c.prefill_s_per_flop for c in all_coeffs),
        prefill_overhead_s=min(c.prefill_overhead_s for c in all_coeffs),
        params=base.params,
        layers=base.layers,
        hidden=base.hidden,
        kv_capacity_tokens=max(c.kv_capacity_tokens for c in all_coeffs),
    )
    return _Best(coeffs=coeffs, compute=max(specs, key=lambda h: h.peak_flops))


def _turn_contexts(record: TraceRecord) -> list[tuple[int, int, int]]:
    """(context before the turn, tokens never prefilled before, response tokens) per turn."""
    turns = []
    context = record.prompt_tokens
    fresh = record.prompt_tokens
    for turn, response in enumerate(record.response_tokens):
        turns.append((context, fresh, response))
        context += response
        if turn < len(record.tool_output_tokens):
            fresh = record.tool_output_tokens[turn]
            context += fresh
    return turns


def oracle_bound(
    workload: Workload, records: Sequence[TraceRecord], *, iterations: int | None = None
) -> OracleBound:
    perf = PerfModel(workload.model_spec, workload.perf)
    best = _best(workload, perf)
    coeffs = best.coeffs
    tp = workload.model_spec.rollout_tp
    gpus = workload.gpus
    compute_gpu_s_per_flop = 1.0 / (best.compute.peak_flops * workload.model_spec.train_mfu)
    batches = group_by_iteration(records, workload.episodes_per_iteration)
    if iterations is not None:
        batches = batches[:iterations]
    # The cheapest switch between iterations: a weight update (disaggregated) or a phase switch.
    switch_s = min(perf.weight_sync_s(), perf.colocate_switch_s(gpus))
    alpha = workload.staleness or 0

    works: list[float] = []
    trains: list[float] = []
    criticals: list[float] = []
    for batch in batches:
        decode_tokens = 0
        context_sum = 0.0
        prefill_flops = 0.0
        chains: dict[str, float] = {}
        group_train: dict[str, float] = {}
        for record in batch:
            chain = 0.0
            for context, fresh, response in _turn_contexts(record):
                flops = coeffs.prefill_flops(fresh, context - fresh)
                prefill_flops += flops
                decode_tokens += response
                context_sum += response * context + response * (response - 1) / 2.0
                chain += coeffs.prefill_s(flops) + decode_alone_s(coeffs, context, response)
            chain += sum(record.tool_latency_s) + record.reward_latency_s
            chain += (
                LOG_PROB_PASSES * perf.forward_flops([record.total_tokens]) * compute_gpu_s_per_flop / gpus
            )
            chains[record.prompt_id] = max(chains.get(record.prompt_id, 0.0), chain)
            group_train[record.prompt_id] = group_train.get(record.prompt_id, 0.0) + perf.train_flops(
                [record.total_tokens]
            )
        # Decode: each step costs at least the fixed part plus max(weights + KV read, GEMMs), and a
        # step serves at most max_running requests.
        steps = decode_tokens / workload.max_running_requests
        memory_side = steps * (coeffs.fixed_s + coeffs.weights_s) + coeffs.per_context_token_s * context_sum
        compute_side = steps * coeffs.fixed_s + coeffs.per_sequence_s * decode_tokens
        rollout_gpu_s = tp * max(memory_side, compute_side) + prefill_flops * coeffs.prefill_s_per_flop * tp
        sequences = [r.total_tokens for r in batch]
        train_gpu_s = perf.train_flops(sequences) * compute_gpu_s_per_flop
        logprob_gpu_s = (
            LOG_PROB_PASSES * perf.forward_flops(sequences) * compute_gpu_s_per_flop
            if workload.log_prob_group
            else 0.0
        )
        works.append(rollout_gpu_s + logprob_gpu_s + train_gpu_s)
        trains.append(train_gpu_s)
        # A group's last sample, then the smallest mini-batch that can contain the group.
        prompts = len(group_train)
        size = workload.prompts_per_minibatch
        smallest = prompts % size or size
        ordered = sorted((flops, prompt_id) for prompt_id, flops in group_train.items())
        critical = 0.0
        for prompt_id, chain in chains.items():
            others = [flops for flops, other in ordered if other != prompt_id][: smallest - 1]
            minibatch_flops = group_train[prompt_id] + sum(others)
            critical = max(critical, chain + minibatch_flops * compute_gpu_s_per_flop / gpus)
        criticals.append(critical)

    ends: list[float] = []
    cumulative = 0.0
    for b, work in enumerate(works):
        start = 0.0 if b <= alpha else ends[b - alpha - 1] + switch_s
        previous = ends[b - 1] if b else 0.0
        cumulative += work
        ends.append(
            max(
                previous + trains[b] / gpus,
                start + work / gpus,
                start + criticals[b],
                cumulative / gpus,
            )
        )
    tokens = sum(r.total_tokens for batch in batches for r in batch)
    makespan = ends[-1]
    return OracleBound(
        tokens=tokens,
        makespan_s=makespan,
        tokens_per_s=tokens / makespan,
        iteration_end_s=tuple(ends),
        work_gpu_s=tuple(works),
        critical_path_s=tuple(criticals),
    )
