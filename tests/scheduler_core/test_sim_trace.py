"""Trace generation, the JSONL format and the heavy tail the math generator is built to show."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from scheduler.core.sim.trace import (
    TraceFormatError,
    TraceRecord,
    generate_trace,
    group_by_iteration,
    read_trace,
    read_trace_file,
    write_trace,
)
from scheduler.core.sim.workloads import WORKLOADS, get_workload


def test_same_seed_same_records_other_seed_other_records() -> None:
    workload = get_workload("math-tiny")
    assert generate_trace(workload, 3) == generate_trace(workload, 3)
    assert generate_trace(workload, 3) != generate_trace(workload, 4)


def test_batch_shape_follows_the_workload() -> None:
    workload = get_workload("math-tiny")
    records = generate_trace(workload, 0, iterations=3)
    batches = group_by_iteration(records, workload.episodes_per_iteration)
    assert [len(b) for b in batches] == [workload.episodes_per_iteration] * 3
    prompts = {r.prompt_id for r in batches[0]}
    assert len(prompts) == workload.prompts_per_iteration
    assert all(r.turns == 1 and r.response_tokens[0] <= workload.max_new_tokens for r in records)


@pytest.mark.parametrize("name", ["math-1.5B-64", "math-7B-64", "math-32B-128"])
def test_math_lengths_are_heavy_tailed_as_the_sources_report(name: str) -> None:
    """DESIGN.md / DynaRL Fig. 2: ~95% of queries finish within ~60% of the longest decode.

    Decode time grows with length, so the fitted lognormal must put ~95% of responses under 60%
    of the longest one, with a thin clipped tail at max_new_tokens.
    """
    workload = get_workload(name)
    lengths = sorted(r.response_tokens[0] for r in generate_trace(workload, 0, iterations=1))
    longest = lengths[-1]
    within = sum(1 for n in lengths if n <= 0.6 * longest) / len(lengths)
    assert 0.93 <= within <= 0.975
    clipped = sum(1 for n in lengths if n >= workload.max_new_tokens) / len(lengths)
    assert 0.002 <= clipped <= 0.03
    median = lengths[len(lengths) // 2]
    assert median < 0.2 * longest  # most responses are short; the tail sets the pace


def test_agentic_later_turns_are_shorter_and_tool_calls_line_up() -> None:
    workload = get_workload("agentic-7B-64")
    records = generate_trace(workload, 0, iterations=1)
    by_turn: dict[int, list[int]] = {}
    for record in records:
        assert len(record.tool_latency_s) == len(record.tool_output_tokens) == record.turns - 1
        assert record.total_tokens <= workload.agentic.context_limit
        for turn, tokens in enumerate(record.response_tokens):
            by_turn.setdefault(turn, []).append(tokens)
    means = [sum(v) / len(v) for _, v in sorted(by_turn.items()) if len(v) >= 50]
    assert len(means) >= 3
    assert all(later < earlier for earlier, later in pairwise(means))
    assert max(r.turns for r in records) > 3
    latencies = sorted(t for r in records for t in r.tool_latency_s)
    # Heavy-tailed tool latency: the p99 is several times the median.
    assert latencies[int(0.99 * len(latencies))] > 5 * latencies[len(latencies) // 2]


def test_write_then_read_round_trips_every_field(tmp_path: Path) -> None:
    for name in ("math-tiny", "agentic-tiny"):
        records = generate_trace(WORKLOADS[name], 7)
        path = tmp_path / f"{name}.jsonl"
        write_trace(path, records, workload=name)
        trace = read_trace_file(path)
        assert list(trace.records) == records
        assert trace.workload == name
        assert read_trace(path) == records


def test_records_without_iteration_are_batched_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "plain.jsonl"
    lines = [{"episode_id": f"e{i}", "prompt_tokens": 10, "response_tokens": [5]} for i in range(5)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    records = read_trace(path)
    assert [r.prompt_id for r in records] == [f"e{i}" for i in range(5)]
    batches = group_by_iteration(records, 2)
    assert [[r.episode_id for r in b] for b in batches] == [["e0", "e1"], ["e2", "e3"], ["e4"]]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not JSON"),
        ('{"episode_id": "x", "response_tokens": [3]}', "missing field 'prompt_tokens'"),
        ('{"episode_id": "x", "prompt_tokens": 3, "response_tokens": [3, 4]}', "need 1 tool latencies"),
        ('{"episode_id": "x", "prompt_tokens": 0, "response_tokens": [3]}', "must be positive"),
    ],
)
def test_bad_lines_name_the_line_and_the_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"trace_format": "dynarl-trace", "version": 1}\n' + line + "\n")
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path)


def test_an_unknown_header_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.jsonl"
    path.write_text('{"trace_format": "dynarl-trace", "version": 99}\n')
    with pytest.raises(TraceFormatError, match="unsupported trace header"):
        read_trace(path)


def test_record_validation() -> None:
    with pytest.raises(ValueError, match="at least one turn"):
        TraceRecord("e", "p", 0, 10, ())
    with pytest.raises(ValueError, match="latencies must be"):
        TraceRecord("e", "p", 0, 10, (1, 2), (-1.0,), (3,))
