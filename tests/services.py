"""Real services for tests: Celery worker and beat processes, free ports, waiting helpers."""

from __future__ import annotations

import json
import os
import resource
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from bench.stack import REPO_ROOT, free_port, stop_process_tree, wait_until
from controlplane.processes import celery_command
from controlplane.supervise import read_status

__all__ = ["REPO_ROOT", "celery_process", "free_port", "stop_process_tree", "wait_until"]


@contextmanager
def memory_ceiling(extra_bytes: int) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``extra_bytes`` for the block:
    code that would grow without bound (what a bug under test might do) fails with MemoryError
    instead of taking the machine down."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    ceiling = psutil.Process().memory_info().vms + extra_bytes
    if hard != resource.RLIM_INFINITY:
        ceiling = min(ceiling, hard)
    resource.setrlimit(resource.RLIMIT_AS, (ceiling, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextmanager
def celery_process(kind: str, env: dict[str, str], workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``celery -A controlplane worker|beat`` process using the given environment."""
    args = celery_command(kind, workdir, hostname=f"test-{os.getpid()}@%h", standalone=True)
    log = open(workdir / f"{kind}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(args, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop_process_tree(proc)
        log.close()


# The run command's Supervisor in a process of its own: it installs signal handlers, which only a
# main thread may.
SUPERVISOR_DRIVER = """
import json, logging, os, sys
from pathlib import Path
from controlplane.supervise import Backoff, Supervisor
config = json.loads(sys.argv[1])
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
supervisor = Supervisor(
    config["programs"], env=dict(os.environ), cwd=config["cwd"],
    status_path=Path(config["status"]), backoff=Backoff(**config["backoff"]),
    stop_timeout_s=config["stop_timeout_s"],
)
sys.exit(supervisor.run())
"""


def python(code: str) -> str:
    """A command line running ``code`` in this Python."""
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


SLEEPER = python("import time; print('up', flush=True); time.sleep(600)")


class SupervisorRun:
    """A supervisor started by ``supervising``: its process, its states and its log."""

    def __init__(self, proc: subprocess.Popen[bytes], status_path: Path, log_path: Path) -> None:
        self.proc, self.status_path, self.log_path = proc, status_path, log_path

    def processes(self) -> dict[str, Any]:
        try:
            return read_status(self.status_path)["processes"]
        except (OSError, ValueError):
            return {}

    def log(self) -> str:
        return self.log_path.read_text()


@contextmanager
def supervising(
    tmp_path: Path, programs: dict[str, str], stop_timeout_s: float = 10, **backoff: float
) -> Iterator[SupervisorRun]:
    """Supervise ``programs`` (name -> command line) until the block ends; ``backoff`` as in Backoff."""
    status_path, log_path = tmp_path / "status.json", tmp_path / "supervisor.log"
    config = {
        "programs": programs,
        "cwd": str(tmp_path),
        "status": str(status_path),
        "backoff": backoff,
        "stop_timeout_s": stop_timeout_s,
    }
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR_DRIVER, json.dumps(config)],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        run = SupervisorRun(proc, status_path, log_path)
        try:
            assert wait_until(lambda: set(run.processes()) == set(programs), timeout_s=30), run.log()
            yield run
        finally:
            stop_process_tree(proc)
