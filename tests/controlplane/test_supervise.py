"""The run command's supervisor on real processes: restarts with exponential backoff, forever, and a
stop that leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from controlplane.supervise import Backoff, describe_exit
from tests.services import SLEEPER, python, supervising, wait_until


def _restart_delays(log: str, name: str) -> list[tuple[int, float]]:
    return [
        (int(attempt), float(delay))
        for attempt, delay in re.findall(
            rf"^{name} exited .*; restart attempt (\d+) in ([\d.]+) s$", log, re.M
        )
    ]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_backoff_doubles_up_to_its_cap() -> None:
    backoff = Backoff(initial_s=1, factor=2, max_s=10)
    assert [backoff.delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


def test_exit_descriptions_name_the_code_or_the_signal() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"


def test_a_process_that_keeps_crashing_is_restarted_forever_with_growing_delays(tmp_path: Path) -> None:
    programs = {"crasher": python("import sys; sys.exit(3)"), "steady": SLEEPER}
    with supervising(tmp_path, programs, initial_s=0.05, factor=2, max_s=0.2, reset_after_s=60) as run:
        steady_pid = run.processes()["steady"]["pid"]
        # Well past supervisord's FATAL after startretries (3 by default): it is still being retried.
        assert wait_until(lambda: len(_restart_delays(run.log(), "crasher")) >= 6, timeout_s=60), run.log()
        delays = _restart_delays(run.log(), "crasher")
        assert delays[:6] == [(1, 0.05), (2, 0.1), (3, 0.2), (4, 0.2), (5, 0.2), (6, 0.2)]
        assert "crasher exited (exit code 3)" in run.log()
        assert run.processes()["crasher"]["restarts"] >= 5
        # The crashes never touched the other process.
        assert run.processes()["steady"] == {
            "state": "running",
            "pid": steady_pid,
            "restarts": 0,
            "attempt": 0,
            "last_exit": None,
        }


def test_a_run_that_lasted_starts_the_backoff_over(tmp_path: Path) -> None:
    # Each run lasts a second, longer than reset_after_s: every crash is a first attempt again.
    programs = {"flaky": python("import sys, time; time.sleep(1); sys.exit(1)")}
    with supervising(tmp_path, programs, initial_s=0.05, factor=2, max_s=5, reset_after_s=0.5) as run:
        assert wait_until(lambda: len(_restart_delays(run.log(), "flaky")) >= 3, timeout_s=60), run.log()
        assert _restart_delays(run.log(), "flaky")[:3] == [(1, 0.05), (1, 0.05), (1, 0.05)]


def test_status_shows_a_restarting_process_with_its_attempt_and_next_retry(tmp_path: Path) -> None:
    programs = {
        "crasher": python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
        "steady": SLEEPER,
    }
    with supervising(tmp_path, programs, initial_s=600, max_s=600, reset_after_s=600) as run:
        assert wait_until(lambda: run.processes()["crasher"]["state"] == "restarting", timeout_s=30)
        crasher = run.processes()["crasher"]
        assert crasher["attempt"] == 1
        assert crasher["pid"] is None
        assert crasher["last_exit"] == "killed by SIGKILL"
        assert 0 < crasher["next_attempt_in_s"] <= 600
        assert "crasher exited (killed by SIGKILL)" in run.log()
        assert "restart attempt 1 in 600 s" in run.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_process_group_and_what_ignores_it(tmp_path: Path, sig: int) -> None:
    programs = {
        # A child of its own, as a Celery worker has its pool: it must go too.
        "parent": python(
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
            " print('up', flush=True); time.sleep(600)"
        ),
        # Ignores SIGTERM: killed once the stop timeout has passed.
        "stubborn": python(
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
        ),
        "crasher": python("import sys; sys.exit(2)"),
    }
    with supervising(tmp_path, programs, stop_timeout_s=1, initial_s=0.05, max_s=0.05) as run:
        assert wait_until(lambda: run.log().count("| up") == 2, timeout_s=30), run.log()

        def children() -> list[psutil.Process]:
            return psutil.Process(run.proc.pid).children(recursive=True)

        assert wait_until(lambda: len(children()) >= 3, timeout_s=30)
        descendants = children()
        run.proc.send_signal(sig)
        assert run.proc.wait(30) == 128 + sig
    assert wait_until(lambda: not any(_alive(p) for p in descendants), timeout_s=10)
    assert not run.status_path.exists()  # no stale states once it has stopped
    log = run.log()
    assert f"{signal.Signals(sig).name} received: stopping every process" in log
    assert "stubborn did not stop in time: SIGKILL" in log
    assert "parent stopped (killed by SIGTERM)" in log


def test_a_command_that_cannot_start_is_retried_like_a_crash(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-program"
    with supervising(tmp_path, {"missing": str(missing)}, initial_s=0.05, max_s=0.05) as run:
        assert wait_until(lambda: len(_restart_delays(run.log(), "missing")) >= 2, timeout_s=30), run.log()
        assert "missing exited (failed to start: " in run.log()
        assert os.path.basename(missing) in run.log()
