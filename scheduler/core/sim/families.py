"""Response-length families for the benchmark's robustness table: the same episodes as the
workload's generator (prompts, samples, tool calls and their latencies), with response lengths
redrawn from another distribution, so a policy is tried on workloads it was not tuned on.

- ``lognormal``: the generator's own lengths (heavy-tailed; what the policies were built on).
- ``uniform``: no tail: every response between 500 and 1,500 tokens.
- ``pareto``: a power-law tail (alpha 1.5) with the generator's median.
- ``bimodal``: 80% short answers around half the median, 20% long ones near ``max_new_tokens``.
- ``growing``: lengths that grow as the policy learns to reason: the median starts at a quarter of
  the generator's and doubles every iteration.
- ``longer-turns`` (agentic workloads): each later turn of an episode longer than the one before,
  the case where the DataRouter's shorter-turns-first ordering no longer holds.

Drawn only when asked for by name (``EXTRA_MATH_FAMILIES``, not in the table by default): shapes
the policies were not built on, to check a change against more than the table.

- ``constant``: every response near half of ``max_new_tokens`` (within a few percent): no tail,
  and long.
- ``shrinking``: the generator's shape, its median starting at twice the generator's and halving
  every iteration (answers getting shorter as a curriculum eases).
- ``tail-vanishes``: the generator's own lengths for two iterations, then uniform ones.
- ``tail-appears``: uniform lengths for two iterations, then the generator's own.
- ``exponential``: exponentially distributed, the generator's median.
- ``wide``: lognormal at twice the generator's per-sample spread, its median.
- ``short``: every response between 50 and 300 tokens: a rollout of seconds, an iteration that is
  almost all training.
- ``truncated``: every response runs to ``max_new_tokens`` (a policy that never stops): no tail,
  and a rollout bound by how many sequences its engines hold.
- ``rare-outliers``: uniform lengths with one response in a hundred at ``max_new_tokens``: a few
  stragglers far behind everything else.

Every family is deterministic per seed, clips to ``[min_tokens, max_new_tokens]`` and keeps each
record's episode, prompt, iteration, prompt length, tool calls and reward latency.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace
from enum import StrEnum

from scheduler.core.sim.trace import TraceRecord
from scheduler.core.sim.workloads import Workload, WorkloadKind

UNIFORM_RANGE = (500, 1500)
PARETO_ALPHA = 1.5
BIMODAL_LONG_SHARE = 0.2
BIMODAL_SHORT_SIGMA = 0.3
BIMODAL_LONG_FROM = 0.6  # long answers are drawn from this fraction of max_new_tokens up to all of it
GROWING_START = 0.25  # of the generator's median, at iteration 0; it doubles every iteration
SHRINKING_START = 2.0  # of the generator's median, at iteration 0; it halves every iteration
CONSTANT_FRACTION = 0.5  # of max_new_tokens
CONSTANT_SIGMA = 0.05
SWITCH_ITERATION = 2  # tail-vanishes / tail-appears change shape from this iteration on
WIDE_SIGMA_FACTOR = 2.0
SHORT_RANGE = (50, 300)
RARE_OUTLIER_SHARE = 0.01
LONGER_TURNS_GROWTH = 1.6  # turn k's response is about this many times turn k-1's


class LengthFamily(StrEnum):
    LOGNORMAL = "lognormal"
    UNIFORM = "uniform"
    PARETO = "pareto"
    BIMODAL = "bimodal"
    GROWING = "growing"
    LONGER_TURNS = "longer-turns"
    CONSTANT = "constant"
    SHRINKING = "shrinking"
    TAIL_VANISHES = "tail-vanishes"
    TAIL_APPEARS = "tail-appears"
    EXPONENTIAL = "exponential"
    WIDE = "wide"
    SHORT = "short"
    TRUNCATED = "truncated"
    RARE_OUTLIERS = "rare-outliers"

    @property
    def has_tail(self) -> bool:
        """Does this family leave most engines waiting on a few long responses, every
        iteration? (The targets ask more of dynarl there.)"""
        return self not in (
            LengthFamily.UNIFORM,
            LengthFamily.CONSTANT,
            LengthFamily.TAIL_VANISHES,
            LengthFamily.TAIL_APPEARS,
            LengthFamily.SHORT,
            LengthFamily.TRUNCATED,
        )


MATH_FAMILIES = (
    LengthFamily.LOGNORMAL,
    LengthFamily.UNIFORM,
    LengthFamily.PARETO,
    LengthFamily.BIMODAL,
    LengthFamily.GROWING,
)
AGENTIC_FAMILIES = (LengthFamily.LOGNORMAL, LengthFamily.LONGER_TURNS)
EXTRA_MATH_FAMILIES = (
    LengthFamily.CONSTANT,
    LengthFamily.SHRINKING,
    LengthFamily.TAIL_VANISHES,
    LengthFamily.TAIL_APPEARS,
    LengthFamily.EXPONENTIAL,
    LengthFamily.WIDE,
    LengthFamily.SHORT,
    LengthFamily.TRUNCATED,
    LengthFamily.RARE_OUTLIERS,
)


def families_for(workload: Workload) -> tuple[LengthFamily, ...]:
    """The robustness table's families for ``workload``."""
    return AGENTIC_FAMILIES if workload.kind is WorkloadKind.AGENTIC else MATH_FAMILIES


def families_drawn_for(workload: Workload) -> tuple[LengthFamily, ...]:
    """Every family ``reshape`` draws for ``workload``: the table's, and the extra ones."""
    if workload.kind is WorkloadKind.AGENTIC:
        return AGENTIC_FAMILIES
    return (*MATH_FAMILIES, *EXTRA_MATH_FAMILIES)


def median_response(workload: Workload) -> float:
    """The generator's median response of a turn (the first turn, for agentic workloads)."""
    if workload.kind is WorkloadKind.AGENTIC:
        return workload.agentic.first_response_median
    return workload.math.median_fraction * workload.max_new_tokens


def reshape(
    records: Sequence[TraceRecord], workload: Workload, family: LengthFamily, seed: int
) -> list[TraceRecord]:
    """``records`` with response lengths drawn from ``family`` (the records as they are for
    ``lognormal``). Raises ValueError for a family that does not fit the workload's kind."""
    if family is LengthFamily.LOGNORMAL:
        return list(records)
    if family not in families_drawn_for(workload):
        raise ValueError(f"the {family} family is not drawn for {workload.kind} workloads")
    rng = random.Random(f"{workload.name}:{seed}:{family}")
    low = (
        workload.math.min_tokens
        if workload.kind is WorkloadKind.MATH
        else workload.agentic.min_response_tokens
    )
    high = workload.max_new_tokens
    median = median_response(workload)

    def clipped(length: float) -> int:
        return int(min(high, max(low, round(length))))

    reshaped = []
    for record in records:
        if (family is LengthFamily.TAIL_VANISHES and record.iteration < SWITCH_ITERATION) or (
            family is LengthFamily.TAIL_APPEARS and record.iteration >= SWITCH_ITERATION
        ):
            reshaped.append(record)  # the generator's own lengths
            continue
        if family is LengthFamily.LONGER_TURNS:
            first = median * math.exp(workload.agentic.response_sigma * rng.gauss(0.0, 1.0))
            lengths = tuple(
                clipped(first * math.pow(LONGER_TURNS_GROWTH, turn)) for turn in range(record.turns)
            )
        else:
            lengths = tuple(
                clipped(_draw(family, rng, median, high, record.iteration, workload))
                for _ in record.response_tokens
            )
        reshaped.append(replace(record, response_tokens=lengths))
    return reshaped


def _draw(
    family: LengthFamily, rng: random.Random, median: float, high: int, iteration: int, workload: Workload
) -> float:
    if family in (LengthFamily.UNIFORM, LengthFamily.TAIL_VANISHES, LengthFamily.TAIL_APPEARS):
        return rng.uniform(*UNIFORM_RANGE)
    if family is LengthFamily.SHORT:
        return rng.uniform(*SHORT_RANGE)
    if family is LengthFamily.TRUNCATED:
        return high
    if family is LengthFamily.RARE_OUTLIERS:
        return high if rng.random() < RARE_OUTLIER_SHARE else rng.uniform(*UNIFORM_RANGE)
    if family is LengthFamily.CONSTANT:
        return CONSTANT_FRACTION * high * math.exp(CONSTANT_SIGMA * rng.gauss(0.0, 1.0))
    if family is LengthFamily.SHRINKING:
        shrunk = median * SHRINKING_START * math.pow(0.5, max(0, iteration))
        return shrunk * math.exp(workload.math.sigma_sample * rng.gauss(0.0, 1.0))
    if family is LengthFamily.EXPONENTIAL:
        return rng.expovariate(math.log(2.0) / median)  # median = ln 2 / rate
    if family is LengthFamily.WIDE:
        return median * math.exp(WIDE_SIGMA_FACTOR * workload.math.sigma_sample * rng.gauss(0.0, 1.0))
    if family is LengthFamily.PARETO:
        # The median of a Pareto(x_m, alpha) is x_m * 2**(1/alpha).
        scale = median / math.pow(2.0, 1 / PARETO_ALPHA)
        return scale / math.pow(1.0 - rng.random(), 1 / PARETO_ALPHA)
    if family is LengthFamily.BIMODAL:
        if rng.random() < BIMODAL_LONG_SHARE:
            return rng.uniform(BIMODAL_LONG_FROM * high, high)
        return median / 2 * math.exp(BIMODAL_SHORT_SIGMA * rng.gauss(0.0, 1.0))
    if family is LengthFamily.GROWING:
        grown = median * GROWING_START * math.pow(2.0, max(0, iteration))
        return grown * math.exp(workload.math.sigma_sample * rng.gauss(0.0, 1.0))
    raise ValueError(f"no draw for {family}")
