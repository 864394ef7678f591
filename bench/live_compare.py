"""Scheduling policies compared on the live stack: one job spec, run to its last iteration under
each policy, each on its own fresh and identical set of simulated nodes.

    python -m bench.load --compare static-disaggregated,dynarl --nodes 8 --iterations 5
    python -m bench.load --compare static-disaggregated,dynarl --spec job.yaml --hardware H100

The control plane comes up once as deployed (``bench.stack.ControlPlane``). Then, one policy
after the other: ``--nodes`` agents (the real daemon, ``sim`` backend, the same seed, hardware and
speed every time) register under a fresh name prefix; the job is submitted with only its name and
policy changed; the benchmark waits until the job has finished, reads what it did from the database,
stops the agents and deletes that run's rows, so the next policy starts from the same empty cluster.

Both runs see exactly the same episodes: the episodes of every iteration are drawn once, from the
spec's workload and ``--seed``, into a trace file the spec names (``workload.trace``), instead of
from each job's id. The default spec is the scale benchmark's math-RL job sized to every GPU of the
nodes, so no policy finds free GPUs to grow into: what differs is only how each moves GPUs between
the job's own groups. Another spec (``--spec``) must be in dynarl's format; any GPUs it leaves free
on the nodes are there for a policy that takes free devices.

It prints one table, a row per policy (wall time to finish, the simulated time it stands for,
samples per simulated second, decisions, migrations, and the ratio to the first policy, the
baseline), and a second one: the wall seconds each iteration took under each policy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agents.backends.sim.model import JobModel
from bench.specs import job_spec
from bench.stack import (
    AgentFleet,
    ControlPlane,
    Run,
    bootstrap,
    cleanup,
    database_ready,
    server_problems,
    setup_django,
    wait_for,
    wait_job_ended,
)
from jobs.spec import JobSpec, SpecError, load_document, parse_spec
from scheduler.core.policies import POLICY_NAMES
from scheduler.core.sim.trace import write_trace

DEFAULT_NODES = 8
# Real time: a migration's control-plane round trips (~0.3 s a step) then weigh against the
# workload as they would on real GPUs; at speed s they cost s times more simulated time.
DEFAULT_SPEED = 1.0


@dataclass
class PolicyRun:
    """What one policy's job did, read from the database once it finished (or ran out of time)."""

    policy: str
    state: str
    iterations: int
    iterations_total: int
    wall_s: float  # from the job running to its end (or to the timeout)
    iteration_s: list[float]  # wall seconds of each completed iteration
    decisions: int
    reasons: dict[str, int]
    migrations: dict[str, int]  # state -> count
    moved: dict[str, int]  # "donor -> recipient" -> GPUs moved by committed migrations
    mean_gpus: dict[str, float]  # group -> GPUs held, averaged over the run's wall time
    setup_s: float
    errors: dict[str, int] = field(default_factory=dict)  # why migrations rolled back or failed
    log: list[str] = field(default_factory=list)  # one line per decision, in order

    @property
    def finished(self) -> bool:
        return self.state == "succeeded"


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``python -m bench.load --compare A,B``: check the arguments, run, print."""
    policies = [p.strip() for p in args.compare.split(",") if p.strip()]

    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        parser.error(f"--compare: unknown policy {unknown[0]!r} (known: {', '.join(POLICY_NAMES)})")
    if len(policies) < 2 or len(set(policies)) != len(policies):
        parser.error("--compare: name at least two different policies, separated by commas")
    if args.keep:
        parser.error("--keep does not apply to --compare: each policy's nodes go before the next starts")
    if args.iterations < 1:
        parser.error("--iterations: must be at least 1")
    args.nodes = DEFAULT_NODES if args.nodes is None else args.nodes
    args.speed = DEFAULT_SPEED if args.speed is None else args.speed
    if args.nodes < 1 or args.gpus < 1 or args.speed <= 0:
        parser.error("--nodes, --gpus and --speed must be positive")
    setup_django()
    hardware = args.hardware or "H800"
    try:
        template = load_template(args.spec, hardware, args.nodes * args.gpus)
    except ValueError as exc:
        parser.error(f"--spec: {exc}")
    if not database_ready(args.migrate):
        return 2
    return compare(args, policies, template, hardware)


def load_template(path: Path | None, hardware: str, gpus: int) -> dict[str, Any]:
    """The spec every policy runs: ``path``'s (validated, dynarl format) or the default math-RL job
    on all ``gpus``."""

    if path is None:
        return job_spec("compare", 0, hardware, gpus, 1)
    try:
        document = load_document(path.read_text(encoding="utf-8"))
        parse_spec(document)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    except SpecError as exc:
        raise ValueError(str(exc)) from exc
    if not isinstance(document, dict) or "components" not in document:
        raise ValueError(f"{path} is not a job spec in dynarl's format (it has no components)")
    return document


def spec_for(
    template: Mapping[str, Any], policy: str, name: str, iterations: int, trace: str
) -> dict[str, Any]:
    """The template with only its name, policy, iteration count and episodes set (``trace``, a
    path under the agents' --trace-dir). The template's policy parameters stay with its own
    policy; another policy runs with its defaults."""
    spec: dict[str, Any] = json.loads(json.dumps(template))
    params = spec.get("policy", {}).get("params", {}) if spec.get("policy", {}).get("name") == policy else {}
    spec["name"] = name
    spec["backend"] = "sim"
    spec["policy"] = {"name": policy, "params": params}
    spec["workload"] = {**spec.get("workload", {}), "iterations": iterations, "trace": trace}
    return spec


def write_episodes(template: Mapping[str, Any], iterations: int, seed: int, path: Path) -> int:
    """Draw every iteration's episodes once into a trace file; return the samples per iteration."""

    model = JobModel(0, parse_spec(template).to_json(), seed=seed)
    records = [
        replace(r, episode_id=f"it{k}-{r.episode_id}", prompt_id=f"it{k}-{r.prompt_id}", iteration=k)
        for k in range(iterations)
        for r in model.records(k)
    ]
    write_trace(path, records, workload=str(template.get("name", "")))
    return model.samples_per_iteration


def compare(
    args: argparse.Namespace, policies: Sequence[str], template: dict[str, Any], hardware: str
) -> int:
    tag = f"cmp{secrets.token_hex(3)}"
    workdir = Path(tempfile.mkdtemp(prefix=f"dynarl-{tag}-"))
    trace = "episodes.jsonl"  # the agents read traces from under workdir (their --trace-dir)
    samples = write_episodes(template, args.iterations, args.seed, workdir / trace)
    plane = ControlPlane(workdir, tag, args.servers, args.worker_concurrency)
    runs: list[PolicyRun] = []
    logged: list[str] = []
    began = time.time()
    try:
        plane.start()
        for index, policy in enumerate(policies):
            spec = spec_for(template, policy, f"{tag}-{policy}", args.iterations, trace)
            runs.append(run_policy(args, plane, f"{tag}p{index}", policy, spec, hardware, workdir))
    finally:
        logged = plane.stop()
    problems = server_problems(logged)
    if not problems and all(r.finished for r in runs):
        shutil.rmtree(workdir, ignore_errors=True)  # logs stay for a run that went wrong

    print(
        f"Policy comparison, live, started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(began))}: "
        f"{args.nodes} nodes x {args.gpus} {hardware} per policy, sim speed {args.speed:g}x, "
        f"{samples} samples per iteration, {args.iterations} iterations, the same episodes for every policy"
    )
    print(policy_table(runs, samples, args.speed))
    print()
    print(iteration_table(runs))
    print(
        "setup (nodes registered to job running): " + ", ".join(f"{r.policy} {r.setup_s:.0f} s" for r in runs)
    )
    for r in runs:
        if r.decisions or r.migrations:
            moves = ", ".join(f"{k}: {v} GPUs" for k, v in sorted(r.moved.items())) or "none"
            print(f"{r.policy}: decisions {dict(sorted(r.reasons.items()))}; GPUs moved by commits: {moves}")
            print("\n".join(f"  {line}" for line in r.log))
        for error, count in sorted(r.errors.items()):
            print(f"{r.policy}: {count} migration(s) ended with: {error}")
    if problems:
        print(f"server log: {len(problems)} errors / tracebacks, first:")
        print("\n".join(logged[logged.index(problems[0]) :][:40]))
    return 0 if all(r.finished for r in runs) and not problems else 1


def run_policy(
    args: argparse.Namespace,
    plane: ControlPlane,
    tag: str,
    policy: str,
    spec: dict[str, Any],
    hardware: str,
    workdir: Path,
) -> PolicyRun:
    """One policy on its own fresh nodes, from registration to the job's end; its rows are deleted
    afterwards, whatever happened."""
    # Django's models load only after setup_django(); this module is imported before it runs.
    from django.contrib.auth import get_user_model

    from agents.services import progress
    from cluster.models import Node, NodeStatus
    from common.audit import Actor
    from jobs.models import Job, JobState
    from jobs.services import submit_job

    began = time.monotonic()
    cluster = Run(tag=tag, hardware=hardware, bootstrap_raw=secrets.token_urlsafe(24))
    hosts = [f"{tag}-n{i:02d}" for i in range(args.nodes)]
    fleet = AgentFleet(
        hosts,
        url=plane.url,
        token_file=bootstrap(cluster, workdir),
        workdir=workdir,
        gpus=args.gpus,
        hardware=hardware,
        speed=args.speed,
        seed=args.seed,
        processes=args.agent_processes,
        label=f"agents-{policy}",
        trace_dir=workdir,
    )
    try:
        fleet.start()
        watched = [*plane.processes, *fleet.processes]
        ready = Node.objects.filter(name__startswith=f"{tag}-", status=NodeStatus.READY)
        wait_for(
            lambda: ready.count() == args.nodes, 60 + args.nodes, f"{args.nodes} nodes", watched, workdir
        )
        refuse_foreign_free_devices(tag, spec)
        owner = get_user_model().objects.create_user(username=f"{tag}-owner")
        job = submit_job(owner=owner, source=spec, actor=Actor.system("live-compare")).job
        cluster.job_ids.append(job.pk)
        wait_for(
            lambda: (
                Job.objects.filter(pk=job.pk, state=JobState.RUNNING).exists()
                or Job.objects.get(pk=job.pk).is_terminal
            ),
            180,
            f"the {policy} job to run",
            watched,
            workdir,
        )
        setup_s = time.monotonic() - began
        wait_job_ended(job, args.timeout, watched, workdir, f"the {policy} job")
        result = describe(job, policy, setup_s)
        if args.dump is not None:
            dump_run(job, args.dump / f"{policy}.json")
        fleet.stop()
        return result
    finally:
        fleet.kill()
        for leftover in Job.objects.filter(pk__in=cluster.job_ids):
            progress.forget_job(leftover)
        cleanup(cluster)


def refuse_foreign_free_devices(tag: str, spec: Mapping[str, Any]) -> None:
    """Other ready nodes' free GPUs the job could run on would change what it measures."""
    # Django's models load only after setup_django(); this module is imported before it runs.
    from cluster.selectors import free_devices

    components = list(spec.get("components", []))
    free = free_devices()
    free = free.exclude(node__name__startswith=f"{tag}-")
    if all(c.get("hardware") for c in components):  # otherwise a component accepts any type
        free = free.filter(hardware__in={kind for c in components for kind in c["hardware"]})
    count = free.count()
    if count:
        raise SystemExit(
            f"{count} free GPUs on other ready nodes could take this job's workers; "
            "run against a database without them, or pass --hardware with a type they do not have"
        )


def describe(job: Any, policy: str, setup_s: float) -> PolicyRun:
    # Django's models load only after setup_django(); this module is imported before it runs.
    from django.utils import timezone

    from common.models import AuditEvent
    from scheduler.models import Migration, MigrationState, SchedulingDecision

    start = job.started_at or timezone.now()
    advances = list(
        AuditEvent.objects.filter(job=job, verb="job.iteration").order_by("at").values_list("at", flat=True)
    )
    iteration_s = [(b - a).total_seconds() for a, b in itertools.pairwise([start, *advances])]
    # Finished when its last iteration was counted (the tick that closes the job comes a beat later).
    if advances and job.iteration >= job.iterations_total:
        end = advances[-1]
    else:
        end = job.finished_at if job.is_terminal and job.finished_at else timezone.now()
    reasons: dict[str, int] = {}
    for reason in SchedulingDecision.objects.filter(job=job).values_list("reason", flat=True):
        reasons[reason] = reasons.get(reason, 0) + 1
    migrations: dict[str, int] = {}
    moved: dict[str, int] = {}
    errors: dict[str, int] = {}
    held = {c.name: float(c.gpus) for c in JobSpec.from_json(job.spec).components}
    gpu_seconds = dict.fromkeys(held, 0.0)
    last = start
    for m in Migration.objects.filter(job=job).order_by("finished_at", "created_at"):
        migrations[m.state] = migrations.get(m.state, 0) + 1
        if m.error:
            errors[m.error[:200]] = errors.get(m.error[:200], 0) + 1
        if m.state != MigrationState.COMMITTED or m.finished_at is None:
            continue
        at = min(max(m.finished_at, start), end)
        for group, gpus in held.items():
            gpu_seconds[group] += gpus * (at - last).total_seconds()
        last = at
        count = len(m.device_uids)
        key = f"{m.donor or 'free'} -> {m.recipient}"
        moved[key] = moved.get(key, 0) + count
        if m.donor in held:
            held[m.donor] -= count
        if m.recipient in held:
            held[m.recipient] += count
    for group, gpus in held.items():
        gpu_seconds[group] += gpus * (end - last).total_seconds()
    wall_s = (end - start).total_seconds()
    return PolicyRun(
        policy=policy,
        state=job.state,
        iterations=job.iteration,
        iterations_total=job.iterations_total,
        wall_s=wall_s,
        iteration_s=iteration_s,
        decisions=sum(reasons.values()),
        reasons=reasons,
        migrations=migrations,
        moved=moved,
        mean_gpus={g: s / wall_s for g, s in gpu_seconds.items()} if wall_s > 0 else dict(held),
        setup_s=setup_s,
        errors=errors,
        log=decision_log(job, start, advances),
    )


def decision_log(job: Any, start: Any, advances: Sequence[Any]) -> list[str]:
    """When each decision came (wall seconds from the job's start, and in which iteration), what
    it moved, and how its migration ended."""
    # Django's models load only after setup_django(); this module is imported before it runs.
    from scheduler.models import SchedulingDecision

    lines = []
    for d in SchedulingDecision.objects.filter(job=job).select_related("migration").order_by("at", "pk"):
        iteration = 1 + sum(1 for a in advances if a <= d.at)
        line = (
            f"+{(d.at - start).total_seconds():6.1f} s  iteration {iteration:>2}  {d.reason:<22} "
            f"{d.donor or 'free'} -> {d.recipient or 'free'}: {len(d.device_uids)} GPUs"
        )
        migration = getattr(d, "migration", None)
        if migration is None:
            line += ", not carried out"
        elif migration.finished_at is not None:
            line += f", {migration.state} in {(migration.finished_at - migration.created_at).total_seconds():.1f} s"
        else:
            line += f", {migration.state}"
        lines.append(line)
    return lines


def dump_run(job: Any, path: Path) -> None:
    """What the job did, as JSON, before its rows go: iteration advances, every tick's outcome,
    decisions with the signals they read and the candidates weighed, migrations with their steps,
    and the per-group telemetry series (the dashboard's own endpoint data)."""
    # Django's models load only after setup_django(); this module is imported before it runs.
    from rest_framework.renderers import JSONRenderer

    from common.models import AuditEvent
    from scheduler import selectors
    from scheduler.api import TelemetryHistorySerializer
    from scheduler.models import Migration, SchedulingDecision, Tick

    start = job.started_at

    def offset(at: Any) -> float | None:
        return None if at is None or start is None else round((at - start).total_seconds(), 3)

    data = {
        "job": {"id": job.pk, "policy": job.policy, "state": job.state, "spec": job.spec},
        "iterations": [
            {"t": offset(at), "payload": payload}
            for at, payload in AuditEvent.objects.filter(job=job, verb="job.iteration")
            .order_by("at")
            .values_list("at", "payload")
        ],
        "ticks": [
            {"t": offset(at), "outcome": outcome, "ms": round(ms, 1)}
            for at, outcome, ms in Tick.objects.filter(job=job)
            .order_by("started_at")
            .values_list("started_at", "outcome", "duration_ms")
        ],
        "decisions": [
            {
                "t": offset(d.at),
                "reason": d.reason,
                "detail": d.detail,
                "donor": d.donor,
                "recipient": d.recipient,
                "devices": len(d.device_uids),
                "inputs": d.inputs,
                "candidates": d.candidates,
            }
            for d in SchedulingDecision.objects.filter(job=job).order_by("at", "pk")
        ],
        "migrations": [
            {
                "t": offset(m.created_at),
                "finished_t": offset(m.finished_at),
                "state": m.state,
                "donor": m.donor,
                "recipient": m.recipient,
                "devices": len(m.device_uids),
                "error": m.error,
                "steps": [
                    {
                        "kind": st.kind,
                        "group": st.group,
                        "nodes": st.nodes,
                        "state": st.state,
                        "t": offset(st.started_at),
                        "finished_t": offset(st.finished_at),
                    }
                    for st in m.steps.order_by("index")
                ],
            }
            for m in Migration.objects.filter(job=job).order_by("created_at")
        ],
        "telemetry": TelemetryHistorySerializer(selectors.job_telemetry(job, since=start)).data,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(JSONRenderer().render(data))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [
        "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows
    ]
    return "\n".join(lines)


def policy_table(runs: Sequence[PolicyRun], samples: int, speed: float) -> str:
    baseline = runs[0] if runs else None
    rows = []
    for r in runs:
        rate = samples * r.iterations / (r.wall_s * speed) if r.wall_s > 0 else 0.0
        if baseline is not None and r.finished and baseline.finished and r.wall_s > 0:
            ratio = f"{baseline.wall_s / r.wall_s:.2f}"
        else:
            ratio = "n/a (unfinished)"
        committed = r.migrations.get("committed", 0)
        rolled_back = r.migrations.get("rolled_back", 0) + r.migrations.get("failed", 0)
        rows.append(
            (
                r.policy,
                f"{r.iterations} / {r.iterations_total}" + ("" if r.finished else f" ({r.state})"),
                f"{r.wall_s:.0f}",
                f"{r.wall_s * speed:,.0f}",
                f"{rate:.1f}",
                str(r.decisions),
                f"{committed} / {rolled_back}",
                " / ".join(f"{g} {v:.1f}" for g, v in r.mean_gpus.items()),
                ratio,
            )
        )
    header = (
        "policy",
        "iterations",
        "wall s",
        "sim s",
        "samples / sim s",
        "decisions",
        "migrations committed / rolled back",
        "mean GPUs per group",
        f"x {baseline.policy if baseline else ''} (throughput)",
    )
    return markdown_table(header, rows)


def iteration_table(runs: Sequence[PolicyRun]) -> str:
    longest = max((len(r.iteration_s) for r in runs), default=0)
    rows = [
        (str(k + 1), *(f"{r.iteration_s[k]:.1f}" if k < len(r.iteration_s) else "" for r in runs))
        for k in range(longest)
    ]
    return markdown_table(("iteration (wall s)", *(r.policy for r in runs)), rows)
