"""One call from a workload name and a policy name to a simulated result."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from scheduler.core.costs import MigrationCostModel
from scheduler.core.policies import build_policy, policy_params
from scheduler.core.predictor import ThroughputPredictor
from scheduler.core.sim.hardware import HARDWARE
from scheduler.core.sim.perf import PerfModel, largest_valid
from scheduler.core.sim.results import SimResult
from scheduler.core.sim.simulator import SimOptions, Simulation
from scheduler.core.sim.stages import ACTOR, INFERENCE, LOG_PROB_PASSES, ROLLOUT, train_s
from scheduler.core.sim.trace import TraceRecord, decode_weighted_context, generate_trace, group_by_iteration
from scheduler.core.sim.workloads import Workload, get_workload


def profiles(workload: Workload, records: Sequence[TraceRecord]) -> dict[str, list[tuple[float, float]]]:
    """What an operator's offline profiling would give the predictor: tokens/s of each GPU group
    at each size, from the performance model on the job's first iteration's lengths."""
    model = workload.model_spec
    perf = PerfModel(model, workload.perf)
    hardware = HARDWARE[workload.hardware_of_nodes()[0]]
    batch = group_by_iteration(records, workload.episodes_per_iteration)[0]
    coeffs = perf.engine_coeffs(hardware)
    engine_rate = perf.engine_peak_tokens_per_s(
        coeffs, workload.max_running_requests, decode_weighted_context(batch), workload.max_new_tokens
    )
    sequences = [r.total_tokens for r in batch]
    tokens = sum(sequences)
    minibatches = max(1, workload.minibatches_per_iteration)
    unit = model.trainer_gpus_per_worker
    result: dict[str, list[tuple[float, float]]] = {ROLLOUT: [], ACTOR: []}
    for gpus in range(model.rollout_tp, workload.gpus + 1, model.rollout_tp):
        result[ROLLOUT].append((float(gpus), engine_rate * gpus / model.rollout_tp))
    forward = LOG_PROB_PASSES * perf.forward_flops(sequences)
    train = perf.train_flops(sequences)
    if workload.log_prob_group:
        result[INFERENCE] = []
    for gpus in range(unit, workload.gpus + 1, unit):
        dp = largest_valid(gpus // unit, workload.valid_trainer_dp)
        if dp <= 0:
            continue
        rate = perf.compute_rate([hardware] * (dp * unit))
        step_s = train_s(perf, train, rate, minibatches=minibatches, data_parallel=dp)
        result[ACTOR].append((float(gpus), tokens / step_s))
        if workload.log_prob_group:
            result[INFERENCE].append((float(gpus), tokens * perf.compute_rate([hardware] * gpus) / forward))
    return result


def job_params(policy: str, workload: Workload, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The policy's parameters, with what the job spec knows filled in where the policy asks."""
    known = {spec.name for spec in policy_params(policy)}
    merged: dict[str, Any] = {}
    if "n_minibatches" in known:
        merged["n_minibatches"] = workload.minibatches_per_iteration
    if "max_running_requests" in known:
        merged["max_running_requests"] = workload.max_running_requests
    merged.update(params or {})
    return merged


def build_simulation(
    workload: Workload | str,
    policy: str,
    *,
    seed: int = 0,
    records: Sequence[TraceRecord] | None = None,
    iterations: int | None = None,
    params: Mapping[str, Any] | None = None,
    options: SimOptions | None = None,
) -> Simulation:
    """A ready-to-run simulation of ``policy`` on ``workload``: the generator's trace for ``seed``,
    or ``records``; the policy gets a predictor seeded with the workload's profiles."""
    spec = get_workload(workload) if isinstance(workload, str) else workload
    if records is None:
        records = generate_trace(spec, seed, iterations=iterations)
    predictor = ThroughputPredictor(profiles(spec, records))
    cost_model = MigrationCostModel(model_params_b=spec.model_spec.params_b)
    instance = build_policy(
        policy, predictor=predictor, cost_model=cost_model, params=job_params(policy, spec, params)
    )
    run_options = options or SimOptions()
    if iterations is not None:
        run_options = replace(run_options, iterations=iterations)
    return Simulation(
        spec, instance, records, cost_model=cost_model, options=run_options, observe=predictor.observe
    )


def simulate(
    workload: Workload | str,
    policy: str,
    *,
    seed: int = 0,
    records: Sequence[TraceRecord] | None = None,
    iterations: int | None = None,
    params: Mapping[str, Any] | None = None,
    options: SimOptions | None = None,
) -> SimResult:
    """Run ``policy`` on ``workload`` (see ``build_simulation``)."""
    return build_simulation(
        workload, policy, seed=seed, records=records, iterations=iterations, params=params, options=options
    ).run()
