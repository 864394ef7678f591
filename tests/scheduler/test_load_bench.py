"""The scale benchmark and its policy comparison in tiny configurations, so they cannot rot: each
brings the control plane and real agent daemons up, runs jobs, prints its tables with figures, and
cleans up after itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agents.models import BootstrapToken
from cluster.models import Node
from jobs.models import Job
from tests.services import REPO_ROOT


@pytest.mark.django_db(transaction=True)
def test_the_scale_benchmark_prints_its_table_from_a_live_run(service_env: dict[str, str]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.load",
            "--nodes",
            "2",
            "--jobs",
            "1",
            "--gpus-per-job",
            "8",
            "--duration",
            "8",
            "--agent-processes",
            "1",
        ],
        cwd=REPO_ROOT,
        env=service_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    rows = dict(re.findall(r"^\| (.+?) +\| (.+) \|$", done.stdout, re.MULTILINE))
    assert "Scale benchmark, started" in done.stdout, output
    assert rows["GPUs (nodes x GPUs)"].startswith("16 (2 x 8)"), output
    # The tick ran and recorded its durations.
    ticks = int(rows["ticks recorded (outcomes)"].split()[0])
    assert ticks > 0, output
    assert all(float(v) > 0 for v in rows["tick duration p50 / p99 / max (ms)"].split(" / ")), output
    # The agents heartbeated, their telemetry was taken, and they timed it.
    heartbeats_ok = int(rows["heartbeats ok / failed"].split(" / ")[0])
    assert heartbeats_ok > 0, output
    assert int(rows["telemetry ingested (samples/s)"].split()[0]) > 0, output
    assert all(float(v) > 0 for v in rows["heartbeat latency p50 / p99 / max (ms)"].split(" / ")), output
    for name in ("command backlog queued p50 / max", "commands delivered, unanswered p50 / max"):
        assert re.fullmatch(r"\d+ / \d+", rows[name]), output
    assert re.fullmatch(r"\d+", rows["decisions made"]), output
    assert re.fullmatch(r"\d+ / \d+.*", rows["migrations started / finished"]), output
    # It leaves nothing behind.
    assert not Node.objects.exists() and not Job.objects.exists() and not BootstrapToken.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_policy_comparison_runs_one_spec_under_each_policy_on_its_own_nodes(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    # A small math job for one 8-GPU node: 6 rollout engines and a 2-rank trainer.
    spec = {
        "name": "compare-smoke",
        "model": {"name": "qwen2.5-1.5b", "params_b": 1.5},
        "workload": {
            "kind": "math",
            "prompts_per_iteration": 64,
            "samples_per_prompt": 4,
            "max_new_tokens": 2048,
        },
        "components": [
            {"name": "rollout", "kind": "rollout", "workers": 6, "min_workers": 2},
            {
                "name": "actor",
                "kind": "actor",
                "workers": 2,
                "min_workers": 2,
                "parallelism": {"tp": 1, "valid_dp": [2, 4, 6]},
                "depends_on": ["rollout"],
            },
        ],
        "policy": {"name": "dynarl", "params": {"sustain_s": 1.0}},
    }
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(spec))
    command = [
        sys.executable, "-m", "bench.load",
        "--compare", "static-disaggregated,dynarl", "--spec", str(spec_file),
        "--nodes", "1", "--iterations", "2", "--speed", "20", "--agent-processes", "1",
    ]  # fmt: skip
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=service_env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Policy comparison, live" in done.stdout and "256 samples per iteration" in done.stdout, output
    rows = {
        cells[0]: cells
        for line in done.stdout.splitlines()
        if line.startswith("| ")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    header = rows["policy"]
    assert header[-1] == "x static-disaggregated (throughput)", output
    for policy in ("static-disaggregated", "dynarl"):
        row = dict(zip(header, rows[policy], strict=True))
        # Each ran its two iterations to the end, in some wall time, with the same episodes.
        assert row["iterations"] == "2 / 2", output
        assert float(row["wall s"]) > 0 and float(row["samples / sim s"]) > 0, output
        assert re.fullmatch(r"\d+ / \d+", row["migrations committed / rolled back"]), output
        assert float(row["x static-disaggregated (throughput)"]) > 0, output
    assert rows["static-disaggregated"][header.index("decisions")] == "0", output
    assert rows["static-disaggregated"][header.index("x static-disaggregated (throughput)")] == "1.00", output
    # The per-iteration table has a row per iteration and a column per policy.
    assert rows["iteration (wall s)"][1:] == ["static-disaggregated", "dynarl"], output
    assert all(float(v) > 0 for k in ("1", "2") for v in rows[k][1:]), output
    # It leaves nothing behind.
    assert not Node.objects.exists() and not Job.objects.exists() and not BootstrapToken.objects.exists()
