"""The oracle bound: no policy, on any placement, may beat it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.core.policies import POLICY_NAMES
from scheduler.core.sim.oracle import oracle_bound
from scheduler.core.sim.runner import simulate
from scheduler.core.sim.trace import generate_trace
from scheduler.core.sim.workloads import Workload, get_workload

HETEROGENEOUS = replace(
    get_workload("math-tiny"), name="math-tiny-mixed", node_hardware=(("H100", 1), ("H20", 1))
)


def workload(name: str) -> Workload:
    return HETEROGENEOUS if name == HETEROGENEOUS.name else get_workload(name)


@pytest.mark.parametrize("name", ["math-tiny", "agentic-tiny", "math-tiny-async", HETEROGENEOUS.name])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_policy_beats_the_oracle(name: str, seed: int) -> None:
    spec = workload(name)
    records = generate_trace(spec, seed)
    bound = oracle_bound(spec, records)
    assert bound.tokens == sum(r.total_tokens for r in records)
    for policy in POLICY_NAMES:
        result = simulate(spec, policy, records=records)
        assert result.tokens == bound.tokens
        assert result.tokens_per_s <= bound.tokens_per_s, policy
        # Iteration by iteration too: no iteration can end before its bound.
        for end, bound_end in zip(result.iteration_end_s, bound.iteration_end_s, strict=True):
            assert end >= bound_end


def test_the_bound_is_tight_enough_to_mean_something() -> None:
    """The bound is not a trivial one: the best static policy reaches a good share of it."""
    spec = get_workload("math-tiny")
    records = generate_trace(spec, 0)
    bound = oracle_bound(spec, records)
    best = max(simulate(spec, p, records=records).tokens_per_s for p in POLICY_NAMES)
    assert best >= 0.6 * bound.tokens_per_s


def test_more_gpus_never_lower_the_bound_and_the_tail_caps_it() -> None:
    spec = get_workload("math-1.5B-64")
    records = generate_trace(spec, 0, iterations=1)
    small = oracle_bound(replace(spec, gpus=32), records)
    large = oracle_bound(spec, records)
    huge = oracle_bound(replace(spec, gpus=4096), records)
    assert small.tokens_per_s <= large.tokens_per_s <= huge.tokens_per_s
    # With endless GPUs only the sequential decode of the longest request remains.
    assert huge.makespan_s == pytest.approx(huge.critical_path_s[0], rel=0.05)


def test_staleness_loosens_the_bound() -> None:
    spec = get_workload("math-tiny-async")
    records = generate_trace(spec, 0)
    synchronous = oracle_bound(replace(spec, staleness=None), records)
    overlapped = oracle_bound(spec, records)
    assert overlapped.makespan_s <= synchronous.makespan_s
