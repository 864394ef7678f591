"""The scale benchmark in a tiny configuration, so it cannot rot: it brings the control plane and
real agent daemons up, runs a job, prints its table with figures, and cleans up after itself."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from agents.models import BootstrapToken, Node
from jobs.models import Job
from tests.services import REPO_ROOT


@pytest.mark.django_db(transaction=True)
def test_the_scale_benchmark_prints_its_table_from_a_live_run(service_env: dict[str, str]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler.load_bench",
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
