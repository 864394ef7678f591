"""The real job on a local Ray cluster, under each static placement: what it generates per second,
where its device time goes, and how long its responses are.

    python -m bench.real_job --migrate
    python -m bench.real_job --iterations 8 --policies static-disaggregated,static-colocated

A Ray cluster of two logical nodes (``--gpus`` logical GPUs each, one CPU each) starts on loopback
(``agents.backends.ray.local_cluster``, as for ``make run``'s ray demo), and the control plane as
deployed (``bench.stack.ControlPlane``). Then, one policy after the other: a ``ray`` agent per Ray
node registers, the same real job (same seed, same model, task and batch; ``runtime/``) is submitted
with its components placed as the policy places them, the benchmark waits until it has succeeded,
reads the results its driver reported (one ``IterationResult`` per iteration), stops the agents and
deletes that run's rows. Same cluster, same seed: what differs is only the placement.

- **disaggregated**: rollout, reference, reward and actor on their own GPUs (1 each of 4);
- **colocated**: the rollout engines and the trainer's ranks time-share every GPU (4 of each), the
  reference and the reward worker on the first two.

It prints three tables: per policy, the wall time, tokens generated per second and trained
samples per second, and the first and last iterations' mean reward; the device time (GPUs × wall)
by component, busy and idle; and the response lengths over all iterations.

Here the GPUs are Ray's logical ones and every worker runs on the CPU: the figures measure this
runtime on this machine, not a GPU cluster. On one host the colocated engines and trainer share
its cores the way colocated workers share a GPU's SMs.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agents.backends.ray import LOOPBACK_ENV
from agents.backends.ray.driver_client import rl_config
from bench.stack import (
    ControlPlane,
    Run,
    bootstrap,
    cleanup,
    database_ready,
    free_port,
    setup_django,
    stop_process,
    wait_for,
    wait_job_ended,
)
from controlplane.processes import local_ray_cluster_command, ray_agent_command
from jobs.spec import parse_spec
from runtime.rl.warm_start import warm_start_weights

NODES = ("bench-ray-0", "bench-ray-1")
POLICIES = ("static-disaggregated", "static-colocated", "dynarl")
NAMESPACE = "dynarl-bench"


@dataclass
class PolicyRun:
    policy: str
    wall_s: float
    results: list[dict[str, Any]]
    # component kind -> GPU-seconds it held over the run, from the job's ownership timeline
    # (time-shared devices count for each holder; a migration's moves are in it)
    held_s: dict[str, float]
    total_devices: int
    state: str
    detail: str = ""
    lengths: Counter[int] = field(default_factory=Counter)
    decisions: int = 0
    # One per migration: strategy, state, wall s, and for a p2p side the seconds the trainer was
    # held (its transfer_state's start to its switch's end: no train step runs between).
    migrations: list[dict[str, Any]] = field(default_factory=list)
    # Seconds from the job's start to each iteration's result being recorded.
    reported_s: list[float] = field(default_factory=list)
    # The policy's reasoning at each iteration boundary (its `replan` audit events), in order.
    replans: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class JobShape:
    """How big the real job is: the default is the live test's and the ray demo's (16 problems a
    batch, a 64-wide 2-layer GPT); a bigger batch and model make iterations long against the
    control loop, which is what moves need to pay back."""

    iterations: int
    seed: int = 0
    gpus: int = 2  # logical GPUs per Ray node
    prompts: int = 16
    hidden_size: int = 64
    num_layers: int = 2
    ppo_epochs: int = 1
    # dynarl's policy params (``policy.params``), as an operator would set them in the spec.
    dynarl_params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, args: argparse.Namespace) -> JobShape:
        return cls(
            iterations=args.iterations,
            seed=args.seed,
            gpus=args.gpus,
            prompts=args.prompts,
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            ppo_epochs=args.ppo_epochs,
            dynarl_params=tuple(args.dynarl_param),
        )


def job_spec(policy: str, shape: JobShape) -> dict[str, Any]:
    """The real job, placed as ``policy`` places it on ``2 × shape.gpus`` GPUs."""
    total = 2 * shape.gpus
    components: list[dict[str, Any]]
    if policy == "static-colocated":
        components = [
            {"name": "rollout", "kind": "rollout", "placement": f"0-{total - 1}"},
            {"name": "reference", "kind": "inference", "placement": "0"},
            {"name": "reward", "kind": "reward", "placement": "1", "depends_on": ["rollout"]},
            {
                "name": "actor",
                "kind": "actor",
                "placement": f"0-{total - 1}",
                "depends_on": ["rollout", "reward", "reference"],
            },
        ]
    else:
        components = [
            {"name": "rollout", "kind": "rollout", "workers": total - 3},
            {"name": "reference", "kind": "inference", "workers": 1},
            {"name": "reward", "kind": "reward", "workers": 1, "depends_on": ["rollout"]},
            {
                "name": "actor",
                "kind": "actor",
                "workers": 1,
                "depends_on": ["rollout", "reward", "reference"],
            },
        ]
        if policy != "static-disaggregated":
            # A moving policy starts from the same split, within bounds it may move in: the rollout
            # keeps one engine, and the trainer grows only to sizes its global batch splits over.
            components[0]["min_workers"] = 1
            sizes = [n for n in (1, 2, 4, 8) if n <= total - 3]
            components[3].update({"max_workers": sizes[-1], "parallelism": {"valid_dp": sizes}})
    return {
        "name": f"bench-real-{policy}",
        "backend": "ray",
        "model": {"name": "tiny-gpt", "params_b": 0.0001},
        "workload": {
            "iterations": shape.iterations,
            "prompts_per_iteration": shape.prompts,
            "samples_per_prompt": 8,
            "max_new_tokens": 40,
        },
        "runtime": {
            "seed": shape.seed,
            "dataset_size": shape.prompts,
            "kl_coef": 0.02,
            "ppo_epochs": shape.ppo_epochs,
            "model": {
                "hidden_size": shape.hidden_size,
                "num_layers": shape.num_layers,
                "num_heads": 4,
                "ffn_hidden_size": 2 * shape.hidden_size,
            },
        },
        "components": components,
        "policy": {"name": policy, **({"params": dict(shape.dynarl_params)} if policy == "dynarl" else {})},
    }


def param_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line, the value read as YAML reads it (``false``, ``0.3``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.real_job", description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--gpus", type=int, default=2, help="logical GPUs per Ray node (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=16, help="problems per iteration (8 samples each)")
    parser.add_argument("--hidden-size", type=int, default=64, help="the policy GPT's width")
    parser.add_argument("--layers", type=int, default=2, help="the policy GPT's depth")
    parser.add_argument(
        "--ppo-epochs",
        type=int,
        default=1,
        help="optimizer steps on each iteration's batch (the trainer's work)",
    )
    parser.add_argument(
        "--target-reward",
        type=float,
        default=0.5,
        help="the mean reward whose first iteration's time is reported (time to target)",
    )
    parser.add_argument(
        "--dynarl-param",
        type=param_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one of dynarl's policy params for its run (repeatable), e.g. colocate=false",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a job may take")
    parser.add_argument("--migrate", action="store_true", help="apply migrations to the configured database")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the processes' logs (their path is printed)"
    )
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if unknown := [p for p in policies if p not in POLICIES]:
        parser.error(f"--policies: the real job runs under {', '.join(POLICIES)}, not {unknown[0]!r}")
    if args.iterations < 1 or args.gpus < 2:
        parser.error("--iterations must be at least 1 and --gpus at least 2")
    shape = JobShape.of(args)
    for policy in policies:
        parse_spec(job_spec(policy, shape))  # refused here, not mid-run
    setup_django()
    if not database_ready(args.migrate):
        return 2
    os.environ.update(LOOPBACK_ENV)  # every Ray process of a loopback cluster, agents included
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    workdir = Path(tempfile.mkdtemp(prefix="dynarl-real-job-"))
    runs: list[PolicyRun] = []
    head_port = free_port()
    ray_nodes = [
        subprocess.Popen(
            local_ray_cluster_command(list(NODES), gpus=args.gpus, port=head_port),
            stdout=open(workdir / "ray-cluster.log", "wb"),  # noqa: SIM115 - the process holds it
            stderr=subprocess.STDOUT,
        )
    ]
    plane = ControlPlane(workdir, f"real{secrets.token_hex(3)}", servers=1, worker_concurrency=1)
    try:
        # The supervised warm start is the same for every placement (same model, task and seed):
        # computed once here into the checkpoint directory the drivers read, so no run pays it.
        warm_start_weights(
            rl_config(parse_spec(job_spec(policies[0], shape)).to_json()),
            workdir / "checkpoints",
        )
        wait_for(lambda: port_open(head_port), 120, "the Ray cluster", ray_nodes, workdir)
        plane.start()
        for policy in policies:
            runs.append(run_policy(args, plane, policy, f"127.0.0.1:{head_port}", workdir, ray_nodes))
            detail = f" ({runs[-1].detail})" if runs[-1].state != "succeeded" else ""
            print(f"{policy}: {runs[-1].state}{detail} in {runs[-1].wall_s:.1f} s", flush=True)
    finally:
        plane.stop()
        for proc in reversed(ray_nodes):
            stop_process(proc, timeout_s=60)
        if args.keep_logs:
            print(f"logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report(runs, args))
    return 0 if all(run.state == "succeeded" for run in runs) else 1


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def run_policy(
    args: argparse.Namespace,
    plane: ControlPlane,
    policy: str,
    address: str,
    workdir: Path,
    ray_nodes: Sequence[subprocess.Popen[bytes]],
) -> PolicyRun:
    """One policy: fresh agents on the same Ray nodes, the job from submission to its end; the
    run's rows are deleted afterwards, whatever happened."""
    # Django's models load only after setup_django(); this module is imported before it runs.
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from cluster.models import Node, NodeStatus
    from common.audit import Actor
    from common.models import AuditEvent
    from jobs.models import IterationResult, Worker, WorkerState
    from jobs.services import submit_job
    from scheduler.models import Migration, SchedulingDecision
    from scheduler.selectors import job_timeline

    began = timezone.now()
    tag = f"{plane.tag}-{policy.split('-')[-1]}"
    cluster = Run(tag=tag, hardware="ray-logical", bootstrap_raw=secrets.token_urlsafe(24))
    token_file = bootstrap(cluster, workdir)
    agents = []
    for node in NODES:
        command = ray_agent_command(
            plane.url,
            host=node,
            data_dir=workdir,
            address=address,
            namespace=NAMESPACE,
            checkpoint_dir=workdir / "checkpoints",
        )
        command[command.index("--bootstrap-token-file") + 1] = str(token_file)
        command[command.index("--state-dir") + 1] = str(workdir / tag / node)
        log = open(workdir / f"{tag}-{node}.log", "wb")  # noqa: SIM115 - the process holds it
        agents.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    watched = [*plane.processes, *ray_nodes, *agents]
    try:
        # Registered by this run's agents (a node of an earlier run keeps its name and row).
        ready = Node.objects.filter(name__in=NODES, status=NodeStatus.READY, registered_at__gte=began)
        wait_for(lambda: ready.count() == len(NODES), 180, "the ray agents", watched, workdir)
        owner = get_user_model().objects.create_user(username=f"{tag}-owner")
        spec = job_spec(policy, JobShape.of(args))
        job = submit_job(owner=owner, source=spec, actor=Actor.system("bench-real-job")).job
        cluster.job_ids.append(job.pk)
        wait_job_ended(job, args.timeout, watched, workdir, f"the {policy} job")
        # The agents stop the job's workers (and its driver) before they go: the next placement
        # starts on an empty Ray cluster.
        live = Worker.objects.filter(group__job=job).exclude(state=WorkerState.STOPPED)
        wait_for(lambda: not live.exists(), 120, "the job's workers to stop", watched, workdir)
        rows = list(IterationResult.objects.filter(job=job).order_by("iteration"))
        results = [dict(row.metrics) for row in rows]
        started, finished = job.started_at, job.finished_at or job.started_at
        reported_s = [(row.recorded_at - started).total_seconds() for row in rows] if started else []
        wall = (finished - started).total_seconds() if started and finished else float("nan")
        held: dict[str, float] = {}
        if started and finished:
            for segment in job_timeline(job).segments:
                begin, end = max(segment.start, started), min(segment.end or finished, finished)
                if end > begin:
                    held[segment.kind] = held.get(segment.kind, 0.0) + (end - begin).total_seconds()
        migrations = [migration_row(m) for m in Migration.objects.filter(job=job).prefetch_related("steps")]
        decisions = SchedulingDecision.objects.filter(job=job).count()
        replans = list(
            AuditEvent.objects.filter(job=job, verb="replan")
            .order_by("at", "id")
            .values_list("reason", flat=True)
        )
        lengths: Counter[int] = Counter()
        for result in results:
            for bucket, count in result["response_length"]["histogram"]:
                lengths[int(bucket)] += int(count)
        return PolicyRun(
            policy=policy,
            wall_s=wall,
            results=results,
            held_s=held,
            total_devices=len(NODES) * args.gpus,
            state=job.state,
            detail=job.state_detail,
            lengths=lengths,
            migrations=migrations,
            decisions=decisions,
            replans=replans,
            reported_s=reported_s,
        )
    finally:
        for proc in agents:
            stop_process(proc, timeout_s=60)
        cleanup(cluster)


def migration_row(migration: Any) -> dict[str, Any]:
    """What one migration took: its wall time and, for a trainer's p2p side, how long the trainer
    was held (no step runs from its transfer_state to its switch)."""
    steps = [s for s in migration.steps.all() if not s.is_rollback]
    transfer = next((s for s in steps if s.kind == "transfer_state"), None)
    switch = (
        next((s for s in steps if s.kind == "switch" and s.group == transfer.group), None)
        if transfer
        else None
    )
    held = None
    if transfer is not None and transfer.started_at:
        end = switch.finished_at if switch is not None and switch.finished_at else transfer.finished_at
        held = (end - transfer.started_at).total_seconds() if end else None
    return {
        "strategy": migration.strategy,
        "state": migration.state,
        "wall_s": migration.duration_s,
        "trainer_held_s": held,
        "transfer": dict(transfer.result) if transfer is not None else {},
    }


# Which component's devices each phase of an iteration keeps busy.
PHASE_COMPONENT = {
    "generate": "rollout",
    "reward": "reward",
    "reference": "inference",
    "train": "actor",
    "push": "actor",
}


def time_to_target(run: PolicyRun, target: float) -> str:
    """Seconds from the job's start until the result of its first iteration whose mean reward
    reached ``target`` was recorded, and that iteration; "not reached" otherwise."""
    for iteration, (result, seconds) in enumerate(zip(run.results, run.reported_s, strict=False)):
        if result["mean_reward"] >= target:
            return f"{seconds:.1f} (iteration {iteration})"
    return "not reached"


def report(runs: Sequence[PolicyRun], args: argparse.Namespace) -> str:
    lines = [
        f"Real job, {args.iterations} iterations, seed {args.seed}, 2 Ray nodes x {args.gpus} logical GPUs, "
        "every worker on this machine's CPU",
        "",
        "| placement | state | wall s | tokens generated/s | samples trained/s | reward first -> last | "
        f"accuracy last | s to reward >= {args.target_reward:g} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        if not run.results:
            lines.append(f"| {run.policy} | {run.state}: {run.detail} | | | | | | |")
            continue
        generated = sum(r["tokens_generated"] for r in run.results)
        samples = sum(r["samples"] for r in run.results)
        first = run.results[0]["mean_reward"] if run.results else float("nan")
        last = run.results[-1] if run.results else {"mean_reward": float("nan"), "accuracy": float("nan")}
        lines.append(
            f"| {run.policy} | {run.state} | {run.wall_s:.1f} | {generated / run.wall_s:.0f} | "
            f"{samples / run.wall_s:.2f} | {first:.3f} -> {last['mean_reward']:.3f} | {last['accuracy']:.3f} | "
            f"{time_to_target(run, args.target_reward)} |"
        )
    lines += [
        "",
        "Scheduling: decisions recorded, and migrations by strategy (donor+recipient) and outcome",
        "",
    ]
    lines += [
        "| placement | decisions | strategy | committed | rolled back | failed | median wall s | median trainer held s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        by_strategy: dict[str, list[dict[str, Any]]] = {}
        for row in run.migrations:
            by_strategy.setdefault(row["strategy"], []).append(row)
        if not by_strategy:
            lines.append(f"| {run.policy} | {run.decisions} | none | | | | | |")
        for strategy, rows in sorted(by_strategy.items()):
            states = Counter(r["state"] for r in rows)
            walls = [r["wall_s"] for r in rows if r["wall_s"] is not None]
            holds = [r["trainer_held_s"] for r in rows if r["trainer_held_s"] is not None]
            wall = f"{statistics.median(walls):.1f}" if walls else "-"
            paused = f"{statistics.median(holds):.2f}" if holds else "-"
            lines.append(
                f"| {run.policy} | {run.decisions} | {strategy} | {states.get('committed', 0)} | "
                f"{states.get('rolled_back', 0)} | {states.get('failed', 0)} | {wall} | {paused} |"
            )
    for run in runs:
        if run.replans:
            lines += ["", f"{run.policy} at its iteration boundaries:"]
            lines += [f"- {reason}" for reason in run.replans]
    lines += [
        "",
        "Device time by component: GPU-s held (from the job's ownership timeline: moves included), "
        "busy in its phases (phase time x the GPUs it held on average), the rest idle",
        "",
    ]
    lines += [
        "| placement | component | GPUs (mean) | held GPU-s | busy GPU-s | share of its GPU-s busy | share of all GPU-s |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        if not run.results:
            continue
        total = run.total_devices * run.wall_s
        busy: dict[str, float] = {}
        for result in run.results:
            for phase, seconds in result["seconds"].items():
                component = PHASE_COMPONENT.get(phase)
                if component in run.held_s:
                    busy[component] = busy.get(component, 0.0) + seconds * run.held_s[component] / run.wall_s
        for component, held in sorted(run.held_s.items()):
            spent = busy.get(component, 0.0)
            lines.append(
                f"| {run.policy} | {component} | {held / run.wall_s:.2f} | {held:.1f} | {spent:.1f} | "
                f"{spent / held:.0%} | {spent / total:.0%} |"
            )
    lines += ["", "Response lengths over all iterations (tokens; buckets are powers of two)", ""]
    buckets = sorted({b for run in runs for b in run.lengths})
    lines.append("| placement | " + " | ".join(f"<= {b}" for b in buckets) + " | p50 | p90 | max |")
    lines.append("|---|" + "---|" * (len(buckets) + 3))
    for run in runs:
        p50 = max((r["response_length"]["p50"] for r in run.results), default=0)
        p90 = max((r["response_length"]["p90"] for r in run.results), default=0)
        longest = max((r["response_length"]["max"] for r in run.results), default=0)
        counts = " | ".join(str(run.lengths.get(b, 0)) for b in buckets)
        lines.append(f"| {run.policy} | {counts} | {p50} | {p90} | {longest} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
