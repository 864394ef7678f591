"""Real services for tests: Celery worker and beat processes, free ports, waiting helpers."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def stop_process_tree(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 15
) -> None:
    if proc.poll() is not None:
        return
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    for child in descendants:
        with suppress(psutil.NoSuchProcess):
            child.kill()


@contextmanager
def celery_process(kind: str, env: dict[str, str], workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real ``celery -A controlplane worker|beat`` process using the given environment."""
    args = [sys.executable, "-m", "celery", "-A", "controlplane", kind, "--loglevel", "WARNING"]
    if kind == "worker":
        args += [
            "--pool",
            "solo",
            "--hostname",
            f"test-{os.getpid()}@%h",
            "--without-mingle",
            "--without-gossip",
        ]
    else:
        args += ["--schedule", str(workdir / "celerybeat-schedule")]
    log = open(workdir / f"{kind}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(args, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop_process_tree(proc)
        log.close()
