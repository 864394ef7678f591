"""``python -m bench.policies``: flags, the JSON report and trace replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import policies as bench
from scheduler.core import sim
from scheduler.core.policies import POLICY_NAMES
from scheduler.core.sim.results import WALL_CLOCK_FIELDS

SAMPLES = Path(sim.__file__).parent / "traces"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert bench.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def deterministic(run: dict) -> dict:
    return {k: v for k, v in run["result"].items() if k not in WALL_CLOCK_FIELDS}


def test_every_policy_runs_on_the_same_trace_and_is_compared(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "--workload", "math-tiny", "--no-latency")
    main = [r for r in report["runs"] if not r["variant"]]
    assert sorted(r["policy"] for r in main) == sorted(POLICY_NAMES)
    assert all(r["error"] is None for r in main)
    tokens = {r["result"]["tokens"] for r in main}
    assert len(tokens) == 1  # same trace, every token trained once, whatever the policy
    oracle = report["oracles"]["math-tiny"]["tokens_per_s"]
    assert all(r["result"]["tokens_per_s"] <= oracle for r in main)


def test_policy_selection_keeps_the_baselines_for_the_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(
        capsys, "--workload", "math-tiny", "--policy", "dynarl", "--no-latency", "--iterations", "1"
    )
    assert sorted(r["policy"] for r in report["runs"]) == [
        "dynarl",
        "static-colocated",
        "static-disaggregated",
    ]
    assert all(r["result"]["iterations"] == 1 for r in report["runs"])


def test_agentic_workloads_get_the_router_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, "--workload", "agentic-tiny", "--policy", "dynarl", "--no-latency")
    fifo = [r for r in report["runs"] if r["variant"] == "router=fifo"]
    assert [r["policy"] for r in fifo] == ["static-disaggregated", "dynarl"]
    assert all(r["result"]["router_mode"] == "fifo" for r in fifo)


def test_gpus_flag_resizes_the_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(
        capsys, "--workload", "math-tiny", "--policy", "static-colocated", "--gpus", "8", "--no-latency"
    )
    assert {r["result"]["gpus"] for r in report["runs"]} == {8}


def test_trace_flag_replays_the_generator_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The sample trace is the generator's math-tiny trace for seed 0: same results."""
    replayed = run_json(
        capsys, "--trace", str(SAMPLES / "math-tiny.jsonl"), "--policy", "dynarl", "--no-latency"
    )
    generated = run_json(
        capsys, "--workload", "math-tiny", "--policy", "dynarl", "--no-latency", "--seed", "0"
    )
    assert [deterministic(r) for r in replayed["runs"]] == [deterministic(r) for r in generated["runs"]]


def test_tables_and_latency_section_render(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench.main(
            ["--workload", "agentic-tiny", "--policy", "dynarl", "--iterations", "1", "--latency-calls", "3"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| agentic-tiny | dynarl |" in out
    assert "## DataRouter: priority vs FIFO" in out
    assert "1,024-GPU, 64-group job, 3 calls" in out
    assert "## Targets" in out


def test_unknown_workload_is_a_clean_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--workload", "nope"])
    assert exit_info.value.code == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
