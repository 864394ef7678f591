"""Job traces are read only from under the agent's trace directory: a spec's ``workload.trace``
cannot make the agent (root on GPU hosts) open, or tell whether there is, any other file."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from agents.backends.sim.backend import ManualClock, SimBackend
from agents.backends.sim.model import JobModel
from agents.daemon.registry import load_backend
from scheduler.core.sim.trace import write_trace
from tests.sim_backend.relay import math_spec

JOB = 7


def write_episodes(path: Path) -> Path:
    """A valid trace file at ``path``: what a file worth stealing would look like to the reader."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(path, JobModel(0, math_spec(), seed=0).records(0))
    return path


def launch(backend: SimBackend, trace: str, job: int = JOB) -> dict[str, Any]:
    spec = math_spec()
    spec["workload"]["trace"] = trace
    return backend.launch_workers(
        {"job": job, "spec": spec},
        [{"worker": f"j{job}-r0", "job": job, "group": "rollout", "devices": [{"index": job % 8}]}],
    )


def error_of(outcome: dict[str, Any]) -> str:
    assert not outcome["ok"], outcome
    [worker] = outcome["workers"].values()
    return str(worker["error"])


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """(the trace directory, a directory beside it holding a valid trace)."""
    traces = tmp_path / "traces"
    traces.mkdir()
    write_episodes(tmp_path / "outside" / "trace.jsonl")
    return traces, tmp_path / "outside"


def backend(trace_dir: Path | None) -> SimBackend:
    return SimBackend("a", clock=ManualClock(), faults=[], trace_dir=trace_dir)


def test_an_agent_without_a_trace_directory_reads_no_trace(dirs: tuple[Path, Path]) -> None:
    _, outside = dirs
    error = error_of(launch(backend(None), str(outside / "trace.jsonl")))
    assert "this agent reads no trace files (start it with --trace-dir DIR" in error


def test_a_trace_under_the_trace_directory_is_read(dirs: tuple[Path, Path]) -> None:
    traces, _ = dirs
    write_episodes(traces / "runs" / "episodes.jsonl")
    assert launch(backend(traces), "runs/episodes.jsonl")["ok"]
    # Through a link that stays inside, too.
    (traces / "latest.jsonl").symlink_to(traces / "runs" / "episodes.jsonl")
    assert launch(backend(traces), "latest.jsonl")["ok"]


def test_paths_leading_outside_are_refused_alike_whether_or_not_the_file_exists(
    dirs: tuple[Path, Path],
) -> None:
    traces, outside = dirs
    (traces / "out").symlink_to(outside)
    (traces / "shadow.jsonl").symlink_to(outside / "trace.jsonl")
    (traces / "missing.jsonl").symlink_to(outside / "missing.jsonl")
    refusals: dict[str, str] = {}
    for name in (
        "../outside/trace.jsonl",
        "../outside/missing.jsonl",
        str(outside / "trace.jsonl"),
        str(outside / "missing.jsonl"),
        "out/trace.jsonl",
        "out/missing.jsonl",
        "shadow.jsonl",
        "missing.jsonl",
    ):
        # The name as the message quotes it (cut short when long) is the only part that differs.
        refusals[name] = re.sub(r"trace '.*?': ", "trace <name>: ", error_of(launch(backend(traces), name)))
    # The existing file and the missing one get the same answer, word for word.
    assert refusals["../outside/trace.jsonl"] == refusals["../outside/missing.jsonl"]
    assert refusals[str(outside / "trace.jsonl")] == refusals[str(outside / "missing.jsonl")]
    assert refusals["out/trace.jsonl"] == refusals["out/missing.jsonl"]
    assert refusals["shadow.jsonl"] == refusals["missing.jsonl"]
    assert "without '..'" in refusals["../outside/trace.jsonl"]
    assert "leads outside this agent's trace directory" in refusals["shadow.jsonl"]
    assert all("No such file" not in message for message in refusals.values())


def test_a_file_of_the_trace_directory_may_say_what_is_wrong_with_it(dirs: tuple[Path, Path]) -> None:
    traces, _ = dirs
    (traces / "empty.jsonl").write_text("")
    assert "no records" in error_of(launch(backend(traces), "empty.jsonl"))


def test_the_agents_trace_directory_reaches_the_backend(dirs: tuple[Path, Path]) -> None:
    traces, outside = dirs
    write_episodes(traces / "episodes.jsonl")
    built = load_backend("sim", host="a", options={"clock": ManualClock(), "faults": []}, trace_dir=traces)
    assert isinstance(built, SimBackend)
    assert launch(built, "episodes.jsonl", job=1)["ok"]
    assert not launch(built, os.path.relpath(outside / "trace.jsonl", traces), job=2)["ok"]
