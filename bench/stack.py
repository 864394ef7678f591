"""The one way benchmarks and the live tests bring dynarl's processes up and down.

- the control plane as deployed: daphne (``daphne_command``; one process, or several accepting on
  one listening socket), a Celery worker and Celery beat (``celery_command``) against the
  configured database and broker (``ControlPlane``);
- node agents: the real agent daemon with the ``sim`` backend, many per process
  (``AgentFleet``, running ``python -m bench.agent_host``);
- what a run creates and how it is removed again (``Run``, ``bootstrap``, ``cleanup``), and the
  waiting, stopping and reporting helpers they share.

The command lines are ``controlplane.processes``'s, the ones ``make run`` supervises.
Functions that touch the database import Django's models inside: they run only after the caller
has set Django up (``setup_django``), which a module imported by the agents' processes must not do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from controlplane.processes import celery_command, daphne_command

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent


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


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def wait_for(
    predicate: Any, timeout_s: float, what: str, processes: Sequence[subprocess.Popen[bytes]], workdir: Path
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if any(p.poll() is not None for p in processes):
            raise SystemExit(f"a process ended while waiting for {what}; its logs are in {workdir}")
        time.sleep(0.5)
    raise SystemExit(f"timed out after {timeout_s:g} s waiting for {what}; logs in {workdir}")


def wait_job_ended(
    job: Any, timeout_s: float, watched: Sequence[subprocess.Popen[bytes]], workdir: Path, what: str
) -> None:
    """Until ``job`` (a Job row) ends or ``timeout_s`` passes; SystemExit when one of the
    ``watched`` processes ends meanwhile. The row is fresh on return."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if job.is_terminal:
            return
        if any(p.poll() is not None for p in watched):
            raise SystemExit(f"a process ended while {what} ran; its logs are in {workdir}")
        time.sleep(1.0)
    job.refresh_from_db()


def start_celery(kind: str, workdir: Path, tag: str, concurrency: int) -> subprocess.Popen[bytes]:
    args = celery_command(kind, workdir, hostname=f"{tag}@%h", concurrency=concurrency, standalone=True)
    log = open(workdir / f"{kind}.log", "wb")  # noqa: SIM115 - the process holds it until it ends
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    return subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def listening_socket() -> socket.socket:
    """One listening socket on a free port of 127.0.0.1, shared by every server process."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def start_servers(sock: socket.socket, count: int, log: IO[bytes]) -> list[subprocess.Popen[bytes]]:
    """``count`` daphne processes accepting on ``sock``. A Python process uses one core at most (its
    interpreter lock), so a server runs one per core, as a deployment would."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "LOG_LEVEL": "WARNING"}
    fd = sock.fileno()
    args = daphne_command("--fd", str(fd), verbosity=0)
    procs = [
        subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(fd,))
        for _ in range(count)
    ]
    port = sock.getsockname()[1]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            stop_servers(procs)
            log.seek(0)
            raise SystemExit(f"daphne exited:\n{log.read().decode(errors='replace')}")
        try:
            urllib.request.urlopen(f"http://{HOST}:{port}/api/v1/agent/commands", timeout=1)
        except urllib.error.HTTPError:
            time.sleep(2.0)  # 401: one answers; give the others a moment to finish starting
            return procs
        except OSError:
            time.sleep(0.2)
    stop_servers(procs)
    raise SystemExit("daphne did not start within 60 s")


def stop_servers(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class ControlPlane:
    """The control plane as deployed, for the length of a benchmark: daphne (``servers`` processes
    on one listening socket of a free port of 127.0.0.1), a Celery worker and Celery beat, against
    the configured database and broker. Their logs go to ``workdir``."""

    def __init__(self, workdir: Path, tag: str, servers: int, worker_concurrency: int) -> None:
        self.workdir = workdir
        self.tag = tag
        self.server_count = servers
        self.worker_concurrency = worker_concurrency
        self.sock = listening_socket()
        self.port = int(self.sock.getsockname()[1])
        self.server_log = open(workdir / "daphne.log", "w+b")  # noqa: SIM115 - closed by stop()
        self.servers: list[subprocess.Popen[bytes]] = []
        self.celery: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [*self.servers, *self.celery]

    def start(self) -> None:
        self.servers = start_servers(self.sock, self.server_count, self.server_log)
        self.celery = [
            start_celery("worker", self.workdir, self.tag, self.worker_concurrency),
            start_celery("beat", self.workdir, self.tag, 0),
        ]

    def stop(self) -> list[str]:
        """Stop every process; return the servers' log, line by line."""
        for proc in self.celery:
            stop_process(proc)
        stop_servers(self.servers)
        self.sock.close()
        self.server_log.seek(0)
        logged = self.server_log.read().decode(errors="replace").splitlines()
        self.server_log.close()
        return logged


def server_problems(logged: Sequence[str]) -> list[str]:
    return [line for line in logged if " ERROR " in line or "Traceback" in line]


class AgentFleet:
    """The real agent daemon with the ``sim`` backend for each of ``hosts``, the hosts shared among
    at most ``processes`` processes (this module run with ``--agent-host``)."""

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        url: str,
        token_file: Path,
        workdir: Path,
        gpus: int,
        hardware: str,
        speed: float,
        seed: int,
        processes: int,
        label: str = "agents",
        trace_dir: Path | None = None,
    ) -> None:
        self.hosts = list(hosts)
        self.trace_dir = trace_dir  # the agents' --trace-dir
        self.url = url
        self.token_file = token_file
        self.workdir = workdir
        self.options = {"gpus": gpus, "hardware": hardware, "speed": speed, "seed": seed}
        self.shares = max(1, min(processes, len(self.hosts)))
        self.label = label
        self.running: list[tuple[subprocess.Popen[bytes], Path]] = []

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [proc for proc, _ in self.running]

    def start(self) -> None:
        for p in range(self.shares):
            stats = self.workdir / f"{self.label}-{p}.json"
            log = open(self.workdir / f"{self.label}-{p}.log", "wb")  # noqa: SIM115 - the process holds it
            command = [
                sys.executable, "-m", "bench.agent_host",
                "--url", self.url, "--token-file", str(self.token_file),
                "--state-root", str(self.workdir / self.label), "--stats-file", str(stats),
                "--hosts", ",".join(self.hosts[p :: self.shares]),
                "--gpus", str(self.options["gpus"]), "--hardware", str(self.options["hardware"]),
                "--speed", str(self.options["speed"]), "--seed", str(self.options["seed"]),
            ]  # fmt: skip
            if self.trace_dir is not None:
                command += ["--trace-dir", str(self.trace_dir)]
            self.running.append(
                (subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT), stats)
            )

    def stop(self, grace_s: float = 90.0) -> None:
        """Ask every agent to stop (each then writes its heartbeat figures) and wait for them."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def kill(self) -> None:
        for proc in self.processes:
            stop_process(proc)

    def heartbeats(self) -> tuple[list[list[Any]], list[list[Any]]]:
        """(sent at, latency ms, GPU readings, worker samples) of every heartbeat that was answered,
        (sent at, error) of every one that failed."""
        beats: list[list[Any]] = []
        failures: list[list[Any]] = []
        for _, stats in self.running:
            if stats.exists():
                data = json.loads(stats.read_text())
                beats += data["beats"]
                failures += data["failures"]
        return beats, failures


@dataclass
class Run:
    """One benchmark run: its tag (a prefix of every name it creates) and what it created."""

    tag: str
    hardware: str
    bootstrap_raw: str
    nodes: list[Any] = field(default_factory=list)  # the telemetry benchmark's simulated nodes
    job_ids: list[int] = field(default_factory=list)


def database_ready(migrate: bool) -> bool:
    """Apply migrations when asked; otherwise say so and refuse when some are missing."""
    # Django's models load only after setup_django(); the agents' processes import this module too.
    from django.core.management import call_command
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    if migrate:
        call_command("migrate", verbosity=0)
        return True
    executor = MigrationExecutor(connection)
    if executor.migration_plan(executor.loader.graph.leaf_nodes()):
        print(
            "the configured database has unapplied migrations; run migrate or pass --migrate", file=sys.stderr
        )
        return False
    return True


def bootstrap(run: Run, workdir: Path) -> Path:
    """Record the run's bootstrap token and write it where its agents read it."""
    # Django's models load only after setup_django(); the agents' processes import this module too.
    from agents.models import BootstrapToken
    from common.models import hash_token

    BootstrapToken.objects.create(name=run.tag, key_hash=hash_token(run.bootstrap_raw))
    token_file = workdir / f"{run.tag}-bootstrap-token"
    token_file.write_text(run.bootstrap_raw)
    token_file.chmod(0o600)
    return token_file


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    # Django's models load only after setup_django(); this module is imported before it runs.
    import django

    django.setup()


def cleanup(run: Run) -> None:
    """Delete what a run created: its nodes, jobs, owner, bootstrap token, audit rows and telemetry."""
    # Django's models load only after setup_django(); the agents' processes import this module too.
    from django.contrib.auth import get_user_model

    from agents.models import BootstrapToken
    from cluster.models import Node
    from common import redis as common_redis
    from common.models import AuditEvent
    from jobs.models import Job
    from scheduler import telemetry

    client = common_redis.shared_client()
    for job_id in run.job_ids:
        client.delete(telemetry.window_key(job_id))
    nodes = list(Node.objects.filter(name__startswith=f"{run.tag}-"))
    for node in nodes:
        telemetry.forget_node(node.pk)
    AuditEvent.objects.filter(actor__startswith=f"agent:{run.tag}-").delete()
    AuditEvent.objects.filter(object_type="cluster.node", object_id__in=[str(n.pk) for n in nodes]).delete()
    Job.objects.filter(pk__in=run.job_ids).delete()
    Node.objects.filter(pk__in=[n.pk for n in nodes]).delete()
    get_user_model().objects.filter(username=f"{run.tag}-owner").delete()
    BootstrapToken.objects.filter(name=run.tag).delete()


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines)
