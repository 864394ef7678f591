"""The scale benchmark: many simulated GPU hosts against one control plane, the whole loop live.

    python -m scheduler.load_bench                                  # 128 nodes x 8 GPUs, 4 jobs, 120 s
    python -m scheduler.load_bench --nodes 2 --jobs 1 --gpus-per-job 8 --duration 5   # a smoke run
    python -m scheduler.load_bench --compare static-disaggregated,dynarl   # policies, live

Against the configured DATABASE_URL and REDIS_URL (apply migrations first, or pass --migrate), it
starts the control plane as deployed: daphne (one process per core on one listening socket of
127.0.0.1), a Celery worker and Celery beat. It then starts the node agents: the real agent
daemon (``agents.daemon``) with the ``sim`` backend, many agents per process (``--agent-processes``
processes, each running its share of the agents on threads), speaking the agent protocol over
HTTP: register, heartbeats with telemetry, command long-polls, step reports. Once every node is
ready it submits ``--jobs`` jobs under the ``dynarl`` policy, waits until they run, and measures for
``--duration`` seconds: the tick durations the Tick rows record, the telemetry the heartbeats got
accepted, the heartbeats' latency as the agents saw it, the agents' command backlog (queued and
delivered-but-unanswered AgentCommand rows, sampled every second), and the decisions and
migrations made. It prints one table. Everything it created is deleted afterwards unless --keep.

With ``--compare`` it runs one job spec under each named policy instead, on the same stack, each on
a fresh, identical set of nodes, one policy after the other, and prints how long each took to
finish its iterations (``scheduler.live_compare``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
REPO_ROOT = Path(__file__).resolve().parent.parent


# --- the agents' side: many daemons in one process (no Django here) -------------------------------


def run_agent_host(
    hosts: list[str],
    url: str,
    token_file: Path,
    state_root: Path,
    options: dict[str, Any],
    stats_file: Path,
    trace_dir: Path | None = None,
) -> int:
    """Run one real agent daemon per host on threads until SIGTERM; then write what the
    heartbeats saw (sent at, latency, samples accepted) to ``stats_file``."""
    from agents.daemon.client import ControlPlaneClient
    from agents.daemon.config import AgentConfig, configure_logging
    from agents.daemon.loop import Agent

    configure_logging("WARNING")
    beats: list[tuple[float, float, int, int]] = []
    failures: list[tuple[float, str]] = []
    lock = threading.Lock()

    class TimedClient(ControlPlaneClient):
        """The daemon's client, timing each heartbeat it sends."""

        def request(self, method: str, path: str, **kwargs: Any) -> Any:
            if path != HEARTBEAT_PATH:
                return super().request(method, path, **kwargs)
            sent, began = time.time(), time.perf_counter()
            try:
                reply = super().request(method, path, **kwargs)
            except Exception as exc:
                with lock:
                    failures.append((sent, type(exc).__name__))
                raise
            latency_ms = (time.perf_counter() - began) * 1000
            with lock:
                beats.append(
                    (
                        sent,
                        latency_ms,
                        int(reply.get("accepted_devices", 0)),
                        int(reply.get("accepted_samples", 0)),
                    )
                )
            return reply

    class HostedAgent(Agent):
        """An agent among many in this process: the process's signal handler stops them all."""

        def __init__(self, config: AgentConfig) -> None:
            super().__init__(config)
            self.client = TimedClient(config.url, user_agent=self.client.user_agent)

        def install_signal_handlers(self) -> None:
            pass

    bootstrap = token_file.read_text().strip()
    agents = [
        HostedAgent(
            AgentConfig(
                url=url,
                bootstrap_token=bootstrap,
                backend="sim",
                host=host,
                state_dir=state_root / host,
                backend_options=options,
                nvml=False,
                log_level="WARNING",
                shutdown_grace_s=5.0,
                trace_dir=trace_dir,
            )
        )
        for host in hosts
    ]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threads = [threading.Thread(target=agent.run, name=agent.config.host, daemon=True) for agent in agents]
    for thread in threads:
        thread.start()
        time.sleep(0.02)  # not all registrations in the same instant
    stop.wait()
    for agent in agents:
        agent.stopping.set()
    for thread in threads:
        thread.join(30)
    with lock:
        stats_file.write_text(json.dumps({"beats": beats, "failures": failures}))
    return 0


# --- the control plane's side ---------------------------------------------------------------------


def job_spec(tag: str, index: int, hardware: str, gpus: int, speed_iterations: int) -> dict[str, Any]:
    """A math-RL job under dynarl whose rollout drains into a long tail every iteration."""
    actor = max(1, gpus // 4)
    return {
        "name": f"{tag}-job{index}",
        "model": {"name": "load-1.5b", "params_b": 1.5},
        "workload": {
            "kind": "math",
            "iterations": speed_iterations,
            "prompts_per_iteration": 32 * gpus,
            "samples_per_prompt": 8,
            "max_new_tokens": 8192,
        },
        "components": [
            {
                "name": "rollout",
                "kind": "rollout",
                "workers": gpus - actor,
                "min_workers": 1,
                "hardware": [hardware],
            },
            {
                "name": "actor",
                "kind": "actor",
                "workers": actor,
                "min_workers": 1,
                "max_workers": gpus - 1,
                "depends_on": ["rollout"],
                "hardware": [hardware],
            },
        ],
        "policy": {"name": "dynarl", "params": {"u_low": 0.2, "sustain_s": 3.0, "cooldown_s": 10.0}},
    }


def start_celery(kind: str, workdir: Path, tag: str, concurrency: int) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "celery", "-A", "controlplane", kind, "--loglevel", "WARNING"]
    if kind == "worker":
        args += [
            "--concurrency",
            str(concurrency),
            "--hostname",
            f"{tag}@%h",
            "--without-mingle",
            "--without-gossip",
        ]
    else:
        args += ["--schedule", str(workdir / "celerybeat-schedule")]
    log = open(workdir / f"{kind}.log", "wb")  # noqa: SIM115 - the process holds it until it ends
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    return subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


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


def percentile(values: Sequence[float], q: float) -> float:
    from scheduler.telemetry_bench import percentile as pick

    return pick(values, q)


class ControlPlane:
    """The control plane as deployed, for the length of a benchmark: daphne (``servers`` processes
    on one listening socket of a free port of 127.0.0.1), a Celery worker and Celery beat, against
    the configured database and broker. Their logs go to ``workdir``."""

    def __init__(self, workdir: Path, tag: str, servers: int, worker_concurrency: int) -> None:
        from scheduler.telemetry_bench import listening_socket

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
        from scheduler.telemetry_bench import start_servers

        self.servers = start_servers(self.sock, self.server_count, self.server_log)
        self.celery = [
            start_celery("worker", self.workdir, self.tag, self.worker_concurrency),
            start_celery("beat", self.workdir, self.tag, 0),
        ]

    def stop(self) -> list[str]:
        """Stop every process; return the servers' log, line by line."""
        from scheduler.telemetry_bench import stop_servers

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
                sys.executable, "-m", "scheduler.load_bench", "--agent-host",
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


def database_ready(migrate: bool) -> bool:
    """Apply migrations when asked; otherwise say so and refuse when some are missing."""
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


def bootstrap(run: Any, workdir: Path) -> Path:
    """Record the run's bootstrap token and write it where its agents read it."""
    from agents.models import BootstrapToken
    from controlplane.models import hash_token

    BootstrapToken.objects.create(name=run.tag, key_hash=hash_token(run.bootstrap_raw))
    token_file = workdir / f"{run.tag}-bootstrap-token"
    token_file.write_text(run.bootstrap_raw)
    token_file.chmod(0o600)
    return token_file


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scheduler.load_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--nodes", type=int, default=None, help="nodes (default 128; 8 per policy with --compare)"
    )
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--gpus-per-job", type=int, default=32)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds measured once the jobs run")
    parser.add_argument(
        "--speed", type=float, default=None, help="sim seconds per wall second (default 4; 1 with --compare)"
    )
    parser.add_argument("--agent-processes", type=int, default=4, help="processes the agents share")
    parser.add_argument("--servers", type=int, default=os.cpu_count() or 1, help="daphne processes")
    parser.add_argument("--worker-concurrency", type=int, default=2, help="Celery worker processes")
    parser.add_argument("--migrate", action="store_true", help="apply migrations to the configured database")
    parser.add_argument("--keep", action="store_true", help="leave the nodes, jobs and rows in place")
    parser.add_argument("--hardware", help="the simulated GPUs' type (default H800)")
    parser.add_argument(
        "--seed", type=int, default=0, help="the sim agents' trace seed (all agents share it)"
    )
    compare = parser.add_argument_group("comparing policies (scheduler.live_compare)")
    compare.add_argument(
        "--compare",
        metavar="POLICY,POLICY",
        help="run one job spec under each of these policies, each on its own nodes; the first is the baseline",
    )
    compare.add_argument(
        "--spec",
        type=Path,
        help="the job spec (YAML or JSON, dynarl format); default: a math-RL job filling the nodes",
    )
    compare.add_argument("--iterations", type=int, default=10, help="iterations the job runs")
    compare.add_argument(
        "--dump",
        type=Path,
        help="write what each policy's job did (ticks, decisions, migrations, telemetry) to DIR/<policy>.json",
    )
    compare.add_argument("--timeout", type=float, default=1800.0, help="wall seconds a policy's job may take")
    # The agents' processes run this module again with these:
    parser.add_argument("--agent-host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--token-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--state-root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stats-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hosts", help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.agent_host:
        return run_agent_host(
            args.hosts.split(","),
            args.url,
            args.token_file,
            args.state_root,
            {"gpus": args.gpus, "hardware": args.hardware, "speed": args.speed, "seed": args.seed},
            args.stats_file,
            args.trace_dir,
        )
    if args.compare:
        from scheduler import live_compare

        return live_compare.run(parser, args)
    args.nodes = 128 if args.nodes is None else args.nodes
    args.speed = 4.0 if args.speed is None else args.speed
    if args.jobs * args.gpus_per_job > args.nodes * args.gpus:
        parser.error("the jobs need more GPUs than the nodes have")
    return measure(args)


def measure(args: argparse.Namespace) -> int:
    setup_django()
    import psutil
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from agents.models import AgentCommand, CommandState, Node, NodeStatus
    from agents.services import progress
    from controlplane.audit import Actor
    from jobs.models import Job, JobState
    from jobs.services import submit_job
    from scheduler.models import Migration, SchedulingDecision, Tick
    from scheduler.telemetry_bench import Run, cleanup, table

    if not database_ready(args.migrate):
        return 2

    tag = f"load{secrets.token_hex(3)}"
    # The sim backend models known hardware types only; H800 keeps the jobs off other H100 hosts.
    run = Run(tag=tag, hardware=args.hardware or "H800", bootstrap_raw=secrets.token_urlsafe(24))
    hosts = [f"{tag}-n{i:03d}" for i in range(args.nodes)]
    workdir = Path(tempfile.mkdtemp(prefix=f"dynarl-{tag}-"))
    token_file = bootstrap(run, workdir)
    plane = ControlPlane(workdir, tag, args.servers, args.worker_concurrency)
    fleet = AgentFleet(
        hosts,
        url=plane.url,
        token_file=token_file,
        workdir=workdir,
        gpus=args.gpus,
        hardware=run.hardware,
        speed=args.speed,
        seed=args.seed,
        processes=args.agent_processes,
    )
    backlog: list[tuple[int, int]] = []
    began_setup = time.monotonic()
    finished_cleanly = False
    try:
        plane.start()
        fleet.start()
        nodes = Node.objects.filter(name__startswith=f"{tag}-", status=NodeStatus.READY)
        watched = [*plane.processes, *fleet.processes]
        wait_for(
            lambda: nodes.count() == args.nodes, 60 + args.nodes, f"{args.nodes} nodes", watched, workdir
        )

        owner = get_user_model().objects.create_user(username=f"{tag}-owner")
        for j in range(args.jobs):
            spec = job_spec(tag, j, run.hardware, args.gpus_per_job, 1000)
            run.job_ids.append(submit_job(owner=owner, source=spec, actor=Actor.system("load-bench")).job.pk)
        jobs = Job.objects.filter(pk__in=run.job_ids)
        wait_for(
            lambda: jobs.filter(state=JobState.RUNNING).count() == args.jobs,
            180,
            "the jobs",
            watched,
            workdir,
        )
        setup_s = time.monotonic() - began_setup

        iterations_before = sum(jobs.values_list("iteration", flat=True))
        psutil.cpu_percent(None)
        window_start = timezone.now()
        started = time.time()
        commands = AgentCommand.objects.filter(node__name__startswith=f"{tag}-")
        while time.time() - started < args.duration:
            backlog.append(
                (
                    commands.filter(state=CommandState.QUEUED).count(),
                    commands.filter(state=CommandState.DELIVERED).count(),
                )
            )
            time.sleep(1.0)
        window_end = timezone.now()
        ended = time.time()
        machine_cpu = psutil.cpu_percent(None)
        iterations = sum(jobs.values_list("iteration", flat=True)) - iterations_before
        in_window = {"job__in": run.job_ids}
        ticks = list(
            Tick.objects.filter(**in_window, started_at__gte=window_start, started_at__lt=window_end)
            .exclude(outcome="running")
            .values_list("duration_ms", flat=True)
        )
        tick_outcomes: dict[str, int] = {}
        for outcome in Tick.objects.filter(
            **in_window, started_at__gte=window_start, started_at__lt=window_end
        ).values_list("outcome", flat=True):
            tick_outcomes[outcome] = tick_outcomes.get(outcome, 0) + 1
        decisions = SchedulingDecision.objects.filter(
            **in_window, at__gte=window_start, at__lt=window_end
        ).count()
        migrations = Migration.objects.filter(
            **in_window, created_at__gte=window_start, created_at__lt=window_end
        )
        finished: dict[str, int] = {}
        for state in Migration.objects.filter(
            **in_window, finished_at__gte=window_start, finished_at__lt=window_end
        ).values_list("state", flat=True):
            finished[state] = finished.get(state, 0) + 1
        migrations_started = migrations.count()
        fleet.stop()
        finished_cleanly = True
    finally:
        fleet.kill()
        logged = plane.stop()
        if not args.keep:
            for job in Job.objects.filter(pk__in=run.job_ids):
                progress.forget_job(job)
            cleanup(run)

    beats, failures = fleet.heartbeats()
    if finished_cleanly and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)  # logs stay for a run that failed
    measured = [b for b in beats if started <= b[0] < ended]
    failed = [f for f in failures if started <= f[0] < ended]
    elapsed = ended - started
    latencies = [b[1] for b in measured]
    readings = sum(int(b[2]) for b in measured)
    samples = sum(int(b[3]) for b in measured)
    queued = [q for q, _ in backlog]
    delivered = [d for _, d in backlog]
    problems = server_problems(logged)
    gpus = args.nodes * args.gpus
    rows = [
        (
            "GPUs (nodes x GPUs)",
            f"{gpus} ({args.nodes} x {args.gpus}), agents in {fleet.shares} processes",
        ),
        ("jobs (GPUs each, policy)", f"{args.jobs} ({args.gpus_per_job}, dynarl), sim speed {args.speed:g}x"),
        ("control plane", f"{args.servers} daphne, 1 Celery worker (x{args.worker_concurrency}), beat"),
        ("measured", f"{elapsed:.0f} s, after {setup_s:.0f} s of setup"),
        (
            "ticks recorded (outcomes)",
            f"{len(ticks)} ({', '.join(f'{k} {v}' for k, v in sorted(tick_outcomes.items()))})",
        ),
        (
            "tick duration p50 / p99 / max (ms)",
            " / ".join(f"{percentile(ticks, q):.0f}" for q in (0.5, 0.99, 1.0)),
        ),
        ("heartbeats ok / failed", f"{len(measured)} / {len(failed)} ({len(measured) / elapsed:.1f}/s)"),
        (
            "telemetry ingested (samples/s)",
            f"{(readings + samples) / elapsed:.0f} ({readings / elapsed:.0f} GPU readings + "
            f"{samples / elapsed:.0f} worker samples)",
        ),
        (
            "heartbeat latency p50 / p99 / max (ms)",
            " / ".join(f"{percentile(latencies, q):.0f}" for q in (0.5, 0.99, 1.0)),
        ),
        (
            "command backlog queued p50 / max",
            f"{percentile(queued, 0.5):.0f} / {max(queued, default=0)}",
        ),
        (
            "commands delivered, unanswered p50 / max",
            f"{percentile(delivered, 0.5):.0f} / {max(delivered, default=0)}",
        ),
        ("decisions made", str(decisions)),
        (
            "migrations started / finished",
            f"{migrations_started} / {sum(finished.values())}"
            + (f" ({', '.join(f'{k} {v}' for k, v in sorted(finished.items()))})" if finished else ""),
        ),
        ("iterations completed (all jobs)", str(iterations)),
        ("machine CPU busy (all processes)", f"{machine_cpu:.0f}% of {psutil.cpu_count()} cores"),
        ("server log: errors / tracebacks", str(len(problems))),
    ]
    print(f"Scale benchmark, started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}")
    print(table(rows))
    if failed:
        kinds: dict[str, int] = {}
        for _, kind in failed:
            kinds[kind] = kinds.get(kind, 0) + 1
        print("heartbeat failures: " + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())))
    if problems:
        print("server log (first problem):")
        print("\n".join(logged[logged.index(problems[0]) :][:40]))
    return 0 if measured and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
