"""Response-length families of the robustness table: each keeps the episodes and draws the
lengths it promises, the same for the same seed."""

from __future__ import annotations

import json
import statistics

import pytest

from bench import robustness
from scheduler.core.sim.families import (
    BIMODAL_LONG_FROM,
    CONSTANT_FRACTION,
    SHORT_RANGE,
    SWITCH_ITERATION,
    UNIFORM_RANGE,
    LengthFamily,
    families_for,
    median_response,
    reshape,
)
from scheduler.core.sim.trace import generate_trace
from scheduler.core.sim.workloads import get_workload

MATH = get_workload("math-7B-64")
AGENTIC = get_workload("agentic-7B-64")


@pytest.fixture(scope="module")
def math_trace() -> list:
    return generate_trace(MATH, 0, iterations=3)


def lengths(records: list, iteration: int | None = None) -> list[int]:
    return [t for r in records if iteration is None or r.iteration == iteration for t in r.response_tokens]


@pytest.mark.parametrize("family", [f for f in LengthFamily if f is not LengthFamily.LONGER_TURNS])
def test_a_family_keeps_every_episode_but_its_lengths_and_is_the_same_for_the_same_seed(
    math_trace: list, family: LengthFamily
) -> None:
    reshaped = reshape(math_trace, MATH, family, seed=0)
    assert [
        (r.episode_id, r.prompt_id, r.iteration, r.prompt_tokens, r.reward_latency_s) for r in reshaped
    ] == [(r.episode_id, r.prompt_id, r.iteration, r.prompt_tokens, r.reward_latency_s) for r in math_trace]
    assert reshaped == reshape(math_trace, MATH, family, seed=0)
    assert all(MATH.math.min_tokens <= t <= MATH.max_new_tokens for t in lengths(reshaped))
    if family is not LengthFamily.LOGNORMAL:
        assert lengths(reshaped) != lengths(math_trace)
    if family not in (LengthFamily.LOGNORMAL, LengthFamily.TRUNCATED):  # truncated draws nothing
        assert lengths(reshape(math_trace, MATH, family, seed=1)) != lengths(reshaped)


def test_uniform_lengths_have_no_tail(math_trace: list) -> None:
    drawn = lengths(reshape(math_trace, MATH, LengthFamily.UNIFORM, seed=0))
    assert UNIFORM_RANGE[0] <= min(drawn) and max(drawn) <= UNIFORM_RANGE[1]
    assert not LengthFamily.UNIFORM.has_tail and LengthFamily.PARETO.has_tail


def test_pareto_keeps_the_median_and_has_a_heavier_tail(math_trace: list) -> None:
    drawn = lengths(reshape(math_trace, MATH, LengthFamily.PARETO, seed=0))
    median = median_response(MATH)
    assert 0.85 * median < statistics.median(drawn) < 1.15 * median
    # A power law: one response in twenty is over four times the median, one in a hundred hits the cap.
    ordered = sorted(drawn)
    assert ordered[int(0.95 * len(ordered))] > 4 * median
    assert ordered[int(0.99 * len(ordered))] == MATH.max_new_tokens


def test_bimodal_is_mostly_short_with_a_fifth_long(math_trace: list) -> None:
    drawn = lengths(reshape(math_trace, MATH, LengthFamily.BIMODAL, seed=0))
    long = [t for t in drawn if t >= BIMODAL_LONG_FROM * MATH.max_new_tokens]
    assert 0.17 < len(long) / len(drawn) < 0.23
    assert statistics.median(drawn) < median_response(MATH)


def test_growing_lengths_double_their_median_every_iteration(math_trace: list) -> None:
    reshaped = reshape(math_trace, MATH, LengthFamily.GROWING, seed=0)
    medians = [statistics.median(lengths(reshaped, k)) for k in range(3)]
    assert medians[1] / medians[0] == pytest.approx(2.0, rel=0.2)
    assert medians[2] / medians[1] == pytest.approx(2.0, rel=0.2)


def test_the_families_outside_the_table_draw_the_shapes_they_name(math_trace: list) -> None:
    assert all(f not in families_for(MATH) for f in (LengthFamily.CONSTANT, LengthFamily.WIDE))
    constant = lengths(reshape(math_trace, MATH, LengthFamily.CONSTANT, seed=0))
    half = CONSTANT_FRACTION * MATH.max_new_tokens
    ordered = sorted(constant)
    assert 0.85 * half < ordered[len(ordered) // 100] and ordered[-len(ordered) // 100] < 1.15 * half
    assert not LengthFamily.CONSTANT.has_tail and not LengthFamily.TAIL_VANISHES.has_tail
    shrinking = reshape(math_trace, MATH, LengthFamily.SHRINKING, seed=0)
    medians = [statistics.median(lengths(shrinking, k)) for k in range(3)]
    assert medians[1] / medians[0] == pytest.approx(0.5, rel=0.2)
    assert medians[2] / medians[1] == pytest.approx(0.5, rel=0.2)
    # A tail that vanishes: the generator's own lengths, then uniform ones; and the other way.
    vanishes = reshape(math_trace, MATH, LengthFamily.TAIL_VANISHES, seed=0)
    appears = reshape(math_trace, MATH, LengthFamily.TAIL_APPEARS, seed=0)
    for k in range(3):
        lognormal, uniform = (vanishes, appears) if k < SWITCH_ITERATION else (appears, vanishes)
        assert lengths(lognormal, k) == lengths(math_trace, k)
        assert UNIFORM_RANGE[0] <= min(lengths(uniform, k)) and max(lengths(uniform, k)) <= UNIFORM_RANGE[1]
    median = median_response(MATH)
    exponential = lengths(reshape(math_trace, MATH, LengthFamily.EXPONENTIAL, seed=0))
    assert 0.85 * median < statistics.median(exponential) < 1.15 * median
    wide = sorted(lengths(reshape(math_trace, MATH, LengthFamily.WIDE, seed=0)))
    generator = sorted(lengths(math_trace))
    assert wide[len(wide) // 20] < generator[len(generator) // 20]  # a wider spread both ways
    short = lengths(reshape(math_trace, MATH, LengthFamily.SHORT, seed=0))
    assert SHORT_RANGE[0] <= min(short) and max(short) <= SHORT_RANGE[1]
    assert set(lengths(reshape(math_trace, MATH, LengthFamily.TRUNCATED, seed=0))) == {MATH.max_new_tokens}
    outliers = lengths(reshape(math_trace, MATH, LengthFamily.RARE_OUTLIERS, seed=0))
    at_max = sum(t == MATH.max_new_tokens for t in outliers)
    assert 0 < at_max < 0.03 * len(outliers)
    assert all(UNIFORM_RANGE[0] <= t <= UNIFORM_RANGE[1] for t in outliers if t != MATH.max_new_tokens)
    assert LengthFamily.RARE_OUTLIERS.has_tail
    assert not LengthFamily.SHORT.has_tail and not LengthFamily.TRUNCATED.has_tail


def test_agentic_later_turns_grow_and_math_families_are_refused_for_agentic() -> None:
    trace = generate_trace(AGENTIC, 0, iterations=1)
    reshaped = reshape(trace, AGENTIC, LengthFamily.LONGER_TURNS, seed=0)
    multi = [r for r in reshaped if r.turns > 1]
    assert multi
    for record in multi:
        unclipped = [t for t in record.response_tokens if t < AGENTIC.max_new_tokens]
        assert unclipped == sorted(unclipped)
    assert [r.turns for r in reshaped] == [r.turns for r in trace]
    with pytest.raises(ValueError, match="not drawn for agentic"):
        reshape(trace, AGENTIC, LengthFamily.UNIFORM, seed=0)
    with pytest.raises(ValueError, match="not drawn for agentic"):
        reshape(trace, AGENTIC, LengthFamily.CONSTANT, seed=0)
    with pytest.raises(ValueError, match="not drawn for math"):
        reshape(generate_trace(MATH, 0, iterations=1), MATH, LengthFamily.LONGER_TURNS, seed=0)


def test_the_robustness_program_prints_each_policy_against_the_best_static_placement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--workload", "math-tiny", "--family", "uniform", "--family", "pareto", "--iterations", "1"]
    assert robustness.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["family"]: row for row in report["rows"]}
    assert sorted(rows) == ["pareto", "uniform"]
    for row in rows.values():
        assert not row["errors"]
        best = max(row["tokens_per_s"]["static-colocated"], row["tokens_per_s"]["static-disaggregated"])
        assert row["best_static_tokens_per_s"] == best
        assert max(row["ratios"][p] for p in ("static-colocated", "static-disaggregated")) == 1.0
        assert row["ratios"]["dynarl"] == row["tokens_per_s"]["dynarl"] / best
        assert row["dynarl_placements"] == "D"  # one iteration, run under the spec's placement
    # The same run as tables, with dynarl's targets checked row by row.
    assert robustness.main(argv) == 0
    out = capsys.readouterr().out
    assert "| math-tiny | uniform |" in out and "| math-tiny | pareto |" in out
    assert "2 traces checked" in out
    assert "## What dynarl re-planned" in out and "| math-tiny | uniform | D | none |" in out
    # A family outside the table runs when named; one the workload's kind does not draw, nowhere.
    assert robustness.main(["--workload", "math-tiny", "--family", "constant", "--iterations", "1"]) == 0
    assert "| math-tiny | constant |" in capsys.readouterr().out
    assert robustness.main(["--workload", "math-tiny", "--family", "longer-turns", "--iterations", "1"]) == 0
    assert "0 traces checked" in capsys.readouterr().out
