"""The command lines of dynarl's processes, defined once: ``make run`` supervises them
(``controlplane.stack``), and the benchmarks and live tests start them (``bench.stack``)."""

from __future__ import annotations

import sys
from pathlib import Path

ASGI_APPLICATION = "controlplane.asgi:application"


def daphne_command(*bind: str, verbosity: int = 1) -> list[str]:
    """daphne serving the control plane; ``bind`` is daphne's own: ``-b HOST -p PORT`` or ``--fd N``.
    Verbosity 1 logs every request; 0 keeps a benchmark's servers quiet."""
    return [sys.executable, "-m", "daphne", "-v", str(verbosity), *bind, ASGI_APPLICATION]


def celery_command(
    kind: str, schedule_dir: Path, *, hostname: str, concurrency: int | None = None, standalone: bool = False
) -> list[str]:
    """``celery -A controlplane worker|beat``: a worker named ``hostname`` with ``concurrency``
    processes (None: one, in the worker's own process), or beat keeping its schedule in
    ``schedule_dir``. A ``standalone`` worker skips the start-up exchange with other workers
    (mingle, gossip): a test's or a benchmark's worker has none to meet."""
    args = [sys.executable, "-m", "celery", "-A", "controlplane", kind, "--loglevel", "WARNING"]
    if kind == "worker":
        pool = ["--pool", "solo"] if concurrency is None else ["--concurrency", str(concurrency)]
        args += [*pool, "--hostname", hostname]
        if standalone:
            args += ["--without-mingle", "--without-gossip"]
    else:
        args += ["--schedule", str(schedule_dir / "celerybeat-schedule")]
    return args


def sim_agent_command(
    url: str, *, host: str, data_dir: Path, hardware: str, gpus: int, seed: int, speed: float
) -> list[str]:
    """A node agent with the ``sim`` backend, its token and state under ``data_dir``."""
    return [
        sys.executable, "-m", "agents.daemon", "--url", url,
        "--bootstrap-token-file", str(data_dir / "agent-bootstrap-token"), "--backend", "sim",
        "--backend-option", f"gpus={gpus}", "--backend-option", f"hardware={hardware}",
        "--backend-option", f"seed={seed}", "--backend-option", f"speed={speed:g}",
        "--host", host, "--state-dir", str(data_dir / "agents" / host), "--log-level", "WARNING", "--no-nvml",
    ]  # fmt: skip


def local_ray_cluster_command(nodes: list[str], *, gpus: int, port: int) -> list[str]:
    """A Ray cluster of logical ``nodes`` on loopback (``agents.backends.ray.local_cluster``), the
    head's GCS on ``port``, ``gpus`` logical GPUs per node; it runs until it is stopped."""
    return [
        sys.executable, "-m", "agents.backends.ray.local_cluster", "--nodes", ",".join(nodes),
        "--gpus", str(gpus), "--port", str(port),
    ]  # fmt: skip


def ray_agent_command(
    url: str, *, host: str, data_dir: Path, address: str, namespace: str, checkpoint_dir: Path
) -> list[str]:
    """A node agent with the ``ray`` backend for the Ray node named ``host``."""
    return [
        sys.executable, "-m", "agents.daemon", "--url", url,
        "--bootstrap-token-file", str(data_dir / "agent-bootstrap-token"), "--backend", "ray",
        "--backend-option", f"address={address}", "--backend-option", f"namespace={namespace}",
        "--backend-option", f"checkpoint_dir={checkpoint_dir}",
        "--host", host, "--state-dir", str(data_dir / "agents" / host), "--log-level", "WARNING", "--no-nvml",
    ]  # fmt: skip
