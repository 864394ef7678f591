"""The scale benchmark: many simulated GPU hosts against one control plane, the whole loop live.

    python -m bench.load                                  # 128 nodes x 8 GPUs, 4 jobs, 120 s
    python -m bench.load --nodes 2 --jobs 1 --gpus-per-job 8 --duration 5   # a smoke run
    python -m bench.load --compare static-disaggregated,dynarl   # policies, live

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
finish its iterations (``bench.live_compare``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench import live_compare
from bench.specs import job_spec
from bench.stack import (
    AgentFleet,
    ControlPlane,
    Run,
    bootstrap,
    cleanup,
    database_ready,
    percentile,
    server_problems,
    setup_django,
    table,
    wait_for,
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
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
    compare = parser.add_argument_group("comparing policies (bench.live_compare)")
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
    args = parser.parse_args(argv)
    if args.compare:
        return live_compare.run(parser, args)
    args.nodes = 128 if args.nodes is None else args.nodes
    args.speed = 4.0 if args.speed is None else args.speed
    if args.jobs * args.gpus_per_job > args.nodes * args.gpus:
        parser.error("the jobs need more GPUs than the nodes have")
    return measure(args)


def measure(args: argparse.Namespace) -> int:
    setup_django()
    # Django's models load only after setup_django(); this module is imported before it runs.
    import psutil
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from agents.services import progress
    from cluster.models import AgentCommand, CommandState, Node, NodeStatus
    from common.audit import Actor
    from jobs.models import Job, JobState
    from jobs.services import submit_job
    from scheduler.models import Migration, SchedulingDecision, Tick

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
