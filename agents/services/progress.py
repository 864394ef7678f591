"""Job progress through the control plane: each agent's part of an iteration in, the job's whole
picture out, and ``Job.iteration`` advanced when the trainer has trained the current one.

A job's groups span several hosts, and agents never talk to each other. Each heartbeat carries,
per job with workers on the node, what the node did in the job's current iteration ``k``
(``jobs`` in the heartbeat body, see ``parse``); ``record`` keeps the node's latest report in Redis
and moves the job to ``k + 1`` once every node hosting the job's live actor workers reports
``trained_iteration >= k``. The heartbeat reply's ``jobs`` section (``reply_for``) gives each node
the global picture it needs: the iteration, per group the live members and the samples completed
over all nodes, and the **partition** of each iteration the rollout may work on: the rollout
group's members, frozen when the iteration first opens, over which the agents split its episodes
(episode ``i`` to member ``i mod W``). Agents report which members' shares they started
(``claims``); the share of a member that left before its agent started it is handed to a current
member (``adopt``). docs/sim-backend.md describes the protocol end to end.

Redis holds, per job (keys expire ``PROGRESS_TTL_S`` after the last write; ``<job>`` is the id and
the submission time, so a database reset that reuses ids never meets an old job's state):

- ``dynarl:progress:<job>:nodes``: hash, node name -> its latest report (latest wins);
- ``dynarl:progress:<job>:partition:<k>``: the frozen members of iteration ``k``, per rollout group;
- ``dynarl:progress:<job>:claims:<k>:<group>``: set of members whose share an agent started.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Q

from agents.models import JobPictureChange
from cluster.models import Device, Node
from common import audit
from common import redis as common_redis
from common.audit import Actor
from jobs import services as job_services
from jobs.models import ACTIVE_JOB_STATES, LIVE_WORKER_STATES, Job, JobReason, Worker, WorkerGroup
from scheduler.models import OPEN_MIGRATION_STATES, Migration
from scheduler.telemetry import FieldError, TelemetryError

KEY_PREFIX = "dynarl:progress"
PROGRESS_TTL_S = 86_400
MAX_JOBS = 1_000
MAX_GROUPS = 64
MAX_NAME = 128
MAX_COUNT = 10**9
MAX_CLAIMED_ITERATIONS = 64
MAX_CLAIMS = 4_096
MAX_RESULTS = 16
MAX_RESULT_BYTES = 32_768
MAX_FAILURE = 2_000
ACTOR_KIND = "actor"
ROLLOUT_KIND = "rollout"
# Steps whose workers are leaving their group: new work is no longer partitioned onto them.
LEAVING_STEP_KINDS = ("pause_workers", "drain")


class ProgressError(TelemetryError):
    """A malformed ``jobs`` section; ``errors`` names every field at fault (paths start with
    ``jobs``). Nothing was recorded. A TelemetryError, so the agent protocol answers 400."""


@dataclass(frozen=True)
class GroupCount:
    completed: int
    assigned: int


@dataclass(frozen=True)
class JobProgress:
    """One node's part of one job's current iteration."""

    job: int
    iteration: int
    groups: dict[str, GroupCount]
    trained_iteration: int | None
    claims: dict[int, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    # A job that really runs (the ray backend): its latest iterations' results, and why it cannot
    # go on when a worker or its driver died.
    results: tuple[dict[str, Any], ...] = ()
    failure: str | None = None

    def to_json(self, at: float | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "iteration": self.iteration,
            "groups": {g: [c.completed, c.assigned] for g, c in self.groups.items()},
            "trained_iteration": self.trained_iteration,
        }
        if at is not None:
            data["at"] = at
        return data


# --- keys -----------------------------------------------------------------------------------------


def job_scope(job_id: int, submitted_at: datetime) -> str:
    return f"{job_id}@{int(submitted_at.timestamp() * 1_000_000)}"


def scope_of(job: Job) -> str:
    return job_scope(job.pk, job.submitted_at)


def nodes_key(scope: str) -> str:
    return f"{KEY_PREFIX}:{scope}:nodes"


def partition_key(scope: str, iteration: int) -> str:
    return f"{KEY_PREFIX}:{scope}:partition:{iteration}"


def claims_key(scope: str, iteration: int, group: str) -> str:
    return f"{KEY_PREFIX}:{scope}:claims:{iteration}:{group}"


# --- parsing --------------------------------------------------------------------------------------


def _count(value: Any, path: str, errors: list[FieldError], *, nullable: bool = False) -> int | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        errors.append(FieldError(path, "must be an integer" + (" or null" if nullable else "")))
        return None
    if not 0 <= value <= MAX_COUNT:
        errors.append(FieldError(path, f"must be between 0 and {MAX_COUNT}"))
        return None
    return int(value)


def _name(value: Any, path: str, errors: list[FieldError]) -> str | None:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        errors.append(FieldError(path, f"must be a non-empty string of at most {MAX_NAME} characters"))
        return None
    return value


def _groups(raw: Any, path: str, errors: list[FieldError]) -> dict[str, GroupCount]:
    if not isinstance(raw, Mapping):
        errors.append(FieldError(path, "must be an object mapping group names to counts"))
        return {}
    if len(raw) > MAX_GROUPS:
        errors.append(FieldError(path, f"at most {MAX_GROUPS} groups"))
        return {}
    groups: dict[str, GroupCount] = {}
    for name, counts in raw.items():
        group_path = f"{path}.{name}"
        if _name(name, group_path, errors) is None:
            continue
        if not isinstance(counts, Mapping):
            errors.append(FieldError(group_path, "must be an object with completed and assigned"))
            continue
        completed = _count(counts.get("completed"), f"{group_path}.completed", errors)
        assigned = _count(counts.get("assigned", 0), f"{group_path}.assigned", errors)
        if completed is not None and assigned is not None:
            groups[name] = GroupCount(completed=completed, assigned=assigned)
    return groups


def _results(raw: Any, path: str, errors: list[FieldError]) -> tuple[dict[str, Any], ...]:
    """Iteration results as the driver of a real job reports them: objects with an ``iteration``
    and a finite ``mean_reward``, each kept as sent (bounded in size)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_RESULTS:
        errors.append(FieldError(path, f"must be a list of at most {MAX_RESULTS} iteration results"))
        return ()
    results = []
    for i, item in enumerate(raw):
        item_path = f"{path}[{i}]"
        if not isinstance(item, Mapping):
            errors.append(FieldError(item_path, "must be an object"))
            continue
        before = len(errors)
        _count(item.get("iteration"), f"{item_path}.iteration", errors)
        reward = item.get("mean_reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            errors.append(FieldError(f"{item_path}.mean_reward", "must be a finite number"))
        if len(errors) > before:
            continue
        try:
            size = len(json.dumps(item, allow_nan=False))
        except (TypeError, ValueError):
            errors.append(FieldError(item_path, "must be plain JSON (finite numbers)"))
            continue
        if size > MAX_RESULT_BYTES:
            errors.append(FieldError(item_path, f"must be at most {MAX_RESULT_BYTES} bytes as JSON"))
            continue
        results.append(dict(item))
    return tuple(results)


def _failure(raw: Any, path: str, errors: list[FieldError]) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw.strip() or len(raw) > MAX_FAILURE:
        errors.append(FieldError(path, f"must be a non-empty string of at most {MAX_FAILURE} characters"))
        return None
    return raw


def _claims(raw: Any, path: str, errors: list[FieldError]) -> dict[int, dict[str, tuple[str, ...]]]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or len(raw) > MAX_CLAIMED_ITERATIONS:
        errors.append(FieldError(path, f"must be an object of at most {MAX_CLAIMED_ITERATIONS} iterations"))
        return {}
    claims: dict[int, dict[str, tuple[str, ...]]] = {}
    total = 0
    for iteration, by_group in raw.items():
        iteration_path = f"{path}.{iteration}"
        if not isinstance(iteration, str) or not iteration.isdigit():
            errors.append(FieldError(iteration_path, "iterations are keyed by their number"))
            continue
        if not isinstance(by_group, Mapping):
            errors.append(FieldError(iteration_path, "must be an object mapping groups to worker names"))
            continue
        for group, names in by_group.items():
            group_path = f"{iteration_path}.{group}"
            if _name(group, group_path, errors) is None:
                continue
            if not isinstance(names, list):
                errors.append(FieldError(group_path, "must be a list of worker names"))
                continue
            good = [n for i, n in enumerate(names) if _name(n, f"{group_path}[{i}]", errors) is not None]
            total += len(good)
            claims.setdefault(int(iteration), {})[group] = tuple(good)
    if total > MAX_CLAIMS:
        errors.append(FieldError(path, f"at most {MAX_CLAIMS} claimed workers"))
    return claims


def parse(jobs_section: Any) -> list[JobProgress]:
    """Validate a heartbeat's ``jobs`` list; raises ProgressError naming every bad field."""
    if not isinstance(jobs_section, list):
        raise ProgressError([FieldError("jobs", "must be a list")])
    if len(jobs_section) > MAX_JOBS:
        raise ProgressError([FieldError("jobs", f"at most {MAX_JOBS} jobs")])
    errors: list[FieldError] = []
    parsed: list[JobProgress] = []
    seen: set[int] = set()
    for i, item in enumerate(jobs_section):
        path = f"jobs[{i}]"
        if not isinstance(item, Mapping):
            errors.append(FieldError(path, "must be an object"))
            continue
        before = len(errors)
        job = item.get("job")
        if isinstance(job, bool) or not isinstance(job, int) or job < 1:
            errors.append(FieldError(f"{path}.job", "must be a job id (an integer, at least 1)"))
        elif job in seen:
            errors.append(FieldError(f"{path}.job", f"job {job} is listed twice"))
        iteration = _count(item.get("iteration"), f"{path}.iteration", errors)
        trained = _count(item.get("trained_iteration"), f"{path}.trained_iteration", errors, nullable=True)
        if trained is not None and iteration is not None and trained > iteration:
            errors.append(
                FieldError(f"{path}.trained_iteration", "cannot be ahead of the iteration the node works on")
            )
        groups = _groups(item.get("groups", {}), f"{path}.groups", errors)
        claims = _claims(item.get("claims"), f"{path}.claims", errors)
        results = _results(item.get("results"), f"{path}.results", errors)
        failure = _failure(item.get("failure"), f"{path}.failure", errors)
        if len(errors) > before or not isinstance(job, int) or iteration is None:
            continue
        seen.add(job)
        parsed.append(
            JobProgress(
                job=job,
                iteration=iteration,
                groups=groups,
                trained_iteration=trained,
                claims=claims,
                results=results,
                failure=failure,
            )
        )
    if errors:
        raise ProgressError(errors)
    return parsed


# --- recording ------------------------------------------------------------------------------------


def record(node: Node, jobs_section: Any, *, now: float | None = None) -> None:
    """Keep the node's latest report per job, then advance each job whose trainer is done with its
    current iteration on every node. Validates everything before writing anything; reports for jobs
    that do not exist are ignored."""
    reports = parse(jobs_section)
    if not reports:
        return
    jobs = {
        pk: (job_scope(pk, submitted_at), iteration, total, state)
        for pk, submitted_at, iteration, total, state in Job.objects.filter(
            pk__in=[r.job for r in reports]
        ).values_list("pk", "submitted_at", "iteration", "iterations_total", "state")
    }
    reports = [r for r in reports if r.job in jobs]
    if not reports:
        return
    pipe = common_redis.shared_client().pipeline(transaction=False)
    for report in reports:
        scope = jobs[report.job][0]
        key = nodes_key(scope)
        pipe.hset(key, node.name, json.dumps(report.to_json(now), separators=(",", ":")))
        pipe.expire(key, PROGRESS_TTL_S)
        for iteration, by_group in report.claims.items():
            for group, names in by_group.items():
                if names:
                    claims = claims_key(scope, iteration, group)
                    pipe.sadd(claims, *names)
                    pipe.expire(claims, PROGRESS_TTL_S)
    pipe.execute()
    for report in reports:
        _, iteration, total, state = jobs[report.job]
        if report.results:
            job_services.record_iteration_results(report.job, report.results, node=node.name)
        if report.failure is not None and state in ACTIVE_JOB_STATES:
            job_services.fail_job(
                report.job, JobReason.WORKER_FAILED, Actor.for_agent(node.name), report.failure
            )
            continue
        # Only a report that finishes the job's current iteration can move it: the row lock is
        # taken then and only then (the tick skips a locked job for that beat).
        due = report.trained_iteration is not None and report.trained_iteration >= iteration
        if due and iteration < total and state in ACTIVE_JOB_STATES:
            advance_iteration(report.job, Actor.for_agent(node.name))


def _reports(job: Job) -> dict[str, dict[str, Any]]:
    raw = common_redis.shared_client().hgetall(nodes_key(scope_of(job)))
    return {_text(k): json.loads(v) for k, v in raw.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def actor_nodes(job: Job) -> set[str]:
    """Nodes hosting the job's live actor workers (owned or colocated devices)."""
    owned = Q(worker__group__job=job, worker__group__kind=ACTOR_KIND, worker__state__in=LIVE_WORKER_STATES)
    shared = Q(
        colocated_workers__group__job=job,
        colocated_workers__group__kind=ACTOR_KIND,
        colocated_workers__state__in=LIVE_WORKER_STATES,
    )
    return set(Device.objects.filter(owned | shared).values_list("node__name", flat=True).distinct())


def advance_iteration(job_id: int, actor: Actor) -> int | None:
    """Move the job from ``k`` to ``k + 1`` when every node hosting its live actor workers has
    trained ``k``; returns the new iteration, or None when nothing moved. Never moves backwards,
    never past ``iterations_total``."""
    unlocked = Job.objects.filter(pk=job_id, state__in=ACTIVE_JOB_STATES).first()
    if unlocked is None or _trained_everywhere(unlocked) is None:
        return None
    with transaction.atomic():
        job = (
            Job.objects.select_for_update(no_key=True).filter(pk=job_id, state__in=ACTIVE_JOB_STATES).first()
        )
        if job is None:
            return None
        nodes = _trained_everywhere(job)
        if nodes is None:
            return None
        previous = job.iteration
        job.iteration = previous + 1
        job.save(update_fields=["iteration"])
        audit.record(
            actor,
            "job.iteration",
            job,
            job=job,
            reason=f"iteration {previous} trained on every actor node",
            payload={"from": previous, "to": job.iteration, "nodes": sorted(nodes)},
        )
        return job.iteration


def _trained_everywhere(job: Job) -> set[str] | None:
    """The job's actor nodes when each has trained the job's current iteration, else None."""
    if job.iteration >= job.iterations_total:
        return None
    nodes = actor_nodes(job)
    if not nodes:
        return None
    reports = _reports(job)
    for name in nodes:
        trained = reports.get(name, {}).get("trained_iteration")
        if trained is None or trained < job.iteration:
            return None
    return nodes


# --- the reply --------------------------------------------------------------------------------------


def _aggregate(kind: str, reports: Iterable[Mapping[str, Any]], group: str, iteration: int) -> int | None:
    """Completed samples of ``group`` in ``iteration`` over the nodes' reports: summed, except for
    the trainer, whose nodes each report the whole gang's progress. None when no node reported."""
    counts = [
        int(r["groups"][group][0])
        for r in reports
        if r.get("iteration") == iteration and group in r.get("groups", {})
    ]
    if not counts:
        return None
    return max(counts) if kind == ACTOR_KIND else sum(counts)


def _workload(spec: Any) -> Mapping[str, Any]:
    workload = spec.get("workload", {}) if isinstance(spec, Mapping) else {}
    return workload if isinstance(workload, Mapping) else {}


def _samples_per_iteration(spec: Any) -> int:
    workload = _workload(spec)
    return int(workload.get("prompts_per_iteration", 0)) * int(workload.get("samples_per_prompt", 1))


def _window(state: str, iteration: int, iterations_total: int, spec: Any) -> tuple[int, ...]:
    """Iterations the rollout may work on: the current one and, for an asynchronous job, up to
    ``staleness`` ahead (generated with weights at most that many versions old)."""
    if state not in ACTIVE_JOB_STATES:
        return ()
    staleness = max(0, int(_workload(spec).get("staleness") or 0))
    return tuple(range(iteration, min(iteration + staleness, iterations_total - 1) + 1))


def _leaving(plans: Iterable[Mapping[str, Any]]) -> set[str]:
    leaving: set[str] = set()
    for plan in plans:
        for step in plan.get("steps", []):
            if step.get("kind") in LEAVING_STEP_KINDS:
                leaving.update(step.get("worker_ids", []))
    return leaving


@dataclass(frozen=True)
class JobPicture:
    """What the replies to every node of one job share, from the database. Kept per process and
    reused while the job's ``version`` (its count of ``JobPictureChange`` rows, which database
    triggers write on every change to these fields) stays the same."""

    job_id: int
    scope: str
    version: int
    iteration: int
    iterations_total: int
    state: str
    spec: Any
    samples_per_iteration: int
    window: tuple[int, ...]
    kinds: tuple[tuple[str, str], ...]  # (group, kind), sorted by group
    live: Mapping[str, tuple[str, ...]]  # group -> live members, sorted
    leaving: frozenset[str]

    @property
    def rollout_groups(self) -> list[str]:
        return [g for g, kind in self.kinds if kind == ROLLOUT_KIND]


# job id -> its latest picture in this process. Bounded by the jobs with live workers.
_pictures: dict[int, JobPicture] = {}
_MAX_PICTURES = 4_096

_NODE_JOBS_SQL = """
WITH hosted AS (
    SELECT g.job_id FROM {worker} w
    JOIN {group} g ON g.id = w.group_id
    JOIN {device} d ON d.worker_id = w.id
    WHERE d.node_id = %(node)s AND w.state = ANY(%(live)s)
    UNION
    SELECT g.job_id FROM {colocated} c
    JOIN {device} d ON d.id = c.device_id
    JOIN {worker} w ON w.id = c.worker_id
    JOIN {group} g ON g.id = w.group_id
    WHERE d.node_id = %(node)s AND w.state = ANY(%(live)s)
), joining AS (
    SELECT m.job_id FROM {migration} m
    WHERE m.state = ANY(%(open)s) AND EXISTS (
        SELECT 1 FROM jsonb_array_elements_text(
            CASE WHEN jsonb_typeof(m.device_uids) = 'array' THEN m.device_uids ELSE '[]'::jsonb END
        ) AS moved(uid)
        WHERE starts_with(moved.uid, %(prefix)s)
    )
    EXCEPT SELECT job_id FROM hosted
)
SELECT j.id, j.submitted_at, j.id IN (SELECT job_id FROM joining),
       (SELECT count(*) FROM {change} ch WHERE ch.job_id = j.id)
FROM {job} j
WHERE j.id IN (SELECT job_id FROM hosted UNION SELECT job_id FROM joining)
ORDER BY j.id
"""


def _node_jobs_sql() -> str:
    quote = connection.ops.quote_name
    return _NODE_JOBS_SQL.format(
        worker=quote(Worker._meta.db_table),
        group=quote(WorkerGroup._meta.db_table),
        device=quote(Device._meta.db_table),
        colocated=quote(Worker.colocated_devices.through._meta.db_table),
        migration=quote(Migration._meta.db_table),
        job=quote(Job._meta.db_table),
        change=quote(JobPictureChange._meta.db_table),
    )


def _node_jobs(node: Node) -> list[tuple[int, str, bool, int]]:
    """(job id, scope, joining, version) of the jobs with live workers on the node, and of the
    jobs whose open migrations move devices of the node without the job having workers there yet
    (joining: the node then needs the job's spec). One statement, read before any picture is
    loaded, so a picture is never older than the version it is kept under."""
    with connection.cursor() as cursor:
        cursor.execute(
            _node_jobs_sql(),
            {
                "node": node.pk,
                "live": sorted(LIVE_WORKER_STATES),
                "open": sorted(OPEN_MIGRATION_STATES),
                # device uids are "<node>/gpu<index>" (registration.register creates them so)
                "prefix": f"{node.name}/",
            },
        )
        return [
            (job_id, job_scope(job_id, submitted_at), bool(joining), int(version))
            for job_id, submitted_at, joining, version in cursor.fetchall()
        ]


def _load_pictures(wanted: Mapping[int, tuple[str, int]]) -> dict[int, JobPicture]:
    """Build the pictures of the jobs ``wanted`` (id -> (scope, version)) from the database."""
    ids = list(wanted)
    jobs = {
        pk: (iteration, total, state, spec)
        for pk, iteration, total, state, spec in Job.objects.filter(pk__in=ids).values_list(
            "pk", "iteration", "iterations_total", "state", "spec"
        )
    }
    kinds: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for job_id, name, kind in WorkerGroup.objects.filter(job_id__in=ids).values_list(
        "job_id", "name", "kind"
    ):
        kinds[job_id].append((name, kind))
    live: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for job_id, group, name in (
        Worker.objects.filter(group__job_id__in=ids, state__in=LIVE_WORKER_STATES)
        .order_by("name")
        .values_list("group__job_id", "group__name", "name")
    ):
        live[job_id][group].append(name)
    plans: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for job_id, plan in Migration.objects.filter(job_id__in=ids, state__in=OPEN_MIGRATION_STATES).values_list(
        "job_id", "plan"
    ):
        plans[job_id].append(plan)
    pictures = {}
    for job_id, (iteration, total, state, spec) in jobs.items():
        scope, version = wanted[job_id]
        pictures[job_id] = JobPicture(
            job_id=job_id,
            scope=scope,
            version=version,
            iteration=iteration,
            iterations_total=total,
            state=state,
            spec=spec,
            samples_per_iteration=_samples_per_iteration(spec),
            window=_window(state, iteration, total, spec),
            kinds=tuple(sorted(kinds[job_id])),
            live={g: tuple(names) for g, names in live[job_id].items()},
            leaving=frozenset(_leaving(plans[job_id])),
        )
    return pictures


def _pictures_for(wanted: Mapping[int, tuple[str, int]]) -> dict[int, JobPicture]:
    """The jobs' pictures: kept ones while their version holds, the others loaded (and kept, unless
    this runs inside a transaction, whose own changes may yet roll back)."""
    found: dict[int, JobPicture] = {}
    stale: dict[int, tuple[str, int]] = {}
    for job_id, (scope, version) in wanted.items():
        kept = _pictures.get(job_id)
        if kept is not None and kept.scope == scope and kept.version == version:
            found[job_id] = kept
        else:
            stale[job_id] = (scope, version)
    if stale:
        loaded = _load_pictures(stale)
        found.update(loaded)
        if not connection.in_atomic_block:
            if len(_pictures) + len(loaded) > _MAX_PICTURES:
                _pictures.clear()
            _pictures.update(loaded)
    return found


def reply_for(node: Node) -> dict[str, Any]:
    """The heartbeat reply's ``jobs`` section for the jobs with workers on ``node``, keyed by job id:

    - ``iteration``, ``iterations_total``, ``state``: the job's;
    - ``groups``: per group ``kind``, ``workers`` (live members, sorted, without those leaving in
      an open migration), ``completed`` (samples of the current iteration over all nodes) and
      ``total`` (samples per iteration);
    - ``partitions``: per open iteration (``"<k>"``) and rollout group, the frozen ``workers`` the
      episodes are split over, the members already ``claimed``, and ``adopt`` (member -> worker
      that takes over the share of a member gone before its agent started it);
    - ``spec``: the job's spec, only for a node joining the job through a migration.

    The database part of each job's entry is the job's ``JobPicture``, shared by all its nodes'
    heartbeats until the job changes; per heartbeat this costs one statement and one Redis round
    trip (the nodes' reports, partitions and claims change every second and are read fresh).
    """
    node_jobs = _node_jobs(node)
    if not node_jobs:
        return {}
    pictures = _pictures_for({job_id: (scope, version) for job_id, scope, _, version in node_jobs})
    joining = {job_id for job_id, _, joins, _ in node_jobs if joins}
    shown = [pictures[job_id] for job_id, *_ in node_jobs if job_id in pictures]

    pipe = common_redis.shared_client().pipeline(transaction=False)
    for picture in shown:
        pipe.hgetall(nodes_key(picture.scope))
        for iteration in picture.window:
            pipe.get(partition_key(picture.scope, iteration))
        for iteration in picture.window:
            for group in picture.rollout_groups:
                pipe.smembers(claims_key(picture.scope, iteration, group))
    answers = iter(pipe.execute())

    reply: dict[str, Any] = {}
    for picture in shown:
        reports = [json.loads(v) for v in next(answers).values()]
        frozen: dict[int, dict[str, list[str]]] = {}
        for iteration in picture.window:
            raw = next(answers)
            if raw is not None:
                frozen[iteration] = json.loads(raw)
        claimed: dict[tuple[int, str], set[str]] = {}
        for iteration in picture.window:
            for group in picture.rollout_groups:
                claimed[(iteration, group)] = {_text(c) for c in next(answers)}
        groups: dict[str, Any] = {}
        for group, kind in picture.kinds:
            members = list(picture.live.get(group, ()))
            staying = [w for w in members if w not in picture.leaving] or members
            completed = _aggregate(kind, reports, group, picture.iteration)
            groups[group] = {
                "kind": kind,
                "workers": staying,
                "completed": completed or 0,
                "total": picture.samples_per_iteration,
            }
        _freeze(picture.scope, picture.window, frozen, groups)
        entry: dict[str, Any] = {
            "iteration": picture.iteration,
            "iterations_total": picture.iterations_total,
            "state": picture.state,
            "groups": groups,
            "partitions": _partitions(picture, frozen, groups, claimed),
        }
        if picture.job_id in joining:
            entry["spec"] = picture.spec
        reply[str(picture.job_id)] = entry
    return reply


def _freeze(
    scope: str, window: Sequence[int], frozen: dict[int, dict[str, list[str]]], groups: Mapping[str, Any]
) -> None:
    """Fix the members of each newly opened iteration, once: the first reply that opens it wins
    (SET NX), so every agent partitions the iteration's episodes the same way."""
    missing = [i for i in window if i not in frozen]
    if not missing:
        return
    members = {g: v["workers"] for g, v in groups.items() if v["kind"] == ROLLOUT_KIND}
    if not members or not all(members.values()):
        return  # a rollout group with no live member yet: nothing to split over
    client = common_redis.shared_client()
    value = json.dumps(members, separators=(",", ":"))
    pipe = client.pipeline(transaction=False)
    for iteration in missing:
        pipe.set(partition_key(scope, iteration), value, nx=True, ex=PROGRESS_TTL_S)
    for iteration in missing:
        pipe.get(partition_key(scope, iteration))
    answers = pipe.execute()[len(missing) :]
    for iteration, raw in zip(missing, answers, strict=True):
        if raw is not None:
            frozen[iteration] = json.loads(raw)


def _partitions(
    picture: JobPicture,
    frozen: Mapping[int, Mapping[str, list[str]]],
    groups: Mapping[str, Any],
    claimed: dict[tuple[int, str], set[str]],
) -> dict[str, Any]:
    if not frozen:
        return {}
    order = [(i, g) for i in sorted(frozen) for g in sorted(frozen[i])]
    unread = [key for key in order if key not in claimed]  # a group frozen before it was renamed
    if unread:
        pipe = common_redis.shared_client().pipeline(transaction=False)
        for iteration, group in unread:
            pipe.smembers(claims_key(picture.scope, iteration, group))
        for key, members in zip(unread, pipe.execute(), strict=True):
            claimed[key] = {_text(c) for c in members}
    partitions: dict[str, Any] = {}
    for iteration, group in order:
        members = frozen[iteration][group]
        taken = claimed[(iteration, group)]
        current = groups.get(group, {}).get("workers", [])
        still = set(picture.live.get(group, ()))
        adopt = {
            member: current[position % len(current)]
            for position, member in enumerate(members)
            if member not in taken and (member not in still or member in picture.leaving) and current
        }
        partitions.setdefault(str(iteration), {})[group] = {
            "workers": list(members),
            "claimed": sorted(taken),
            "adopt": adopt,
        }
    return partitions


def redo_from(job: Job, iteration: int) -> None:
    """The job was placed anew and its new workers redo ``iteration`` (and later ones) from the
    start: forget its nodes' reports and the partitions and claims of those iterations, so the
    work is split afresh over the new members (the nodes voided their own progress when their
    workers stopped)."""
    scope = scope_of(job)
    rollout_groups = list(job.groups.filter(kind=ROLLOUT_KIND).values_list("name", flat=True))
    later = range(iteration, job.iterations_total)
    keys = [nodes_key(scope)]
    keys += [partition_key(scope, i) for i in later]
    keys += [claims_key(scope, i, group) for i in later for group in rollout_groups]
    client = common_redis.shared_client()
    for start in range(0, len(keys), 512):
        client.delete(*keys[start : start + 512])


def group_progress(job_id: int) -> dict[str, tuple[int, int]]:
    """Per group of the job, (samples completed over all nodes, samples per iteration) in the job's
    current iteration; groups no node reported for that iteration (tool sandboxes) are left out."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        return {}
    reports = list(_reports(job).values())
    total = _samples_per_iteration(job.spec)
    progress: dict[str, tuple[int, int]] = {}
    for name, kind in WorkerGroup.objects.filter(job=job).order_by("id").values_list("name", "kind"):
        completed = _aggregate(kind, reports, name, job.iteration)
        if completed is not None:
            progress[name] = (min(completed, total) if total else completed, total)
    return progress


def forget_job(job: Job) -> None:
    """Drop a job's progress keys (they also expire on their own)."""
    client = common_redis.shared_client()
    keys = list(client.scan_iter(match=f"{KEY_PREFIX}:{scope_of(job)}:*", count=1000))
    if keys:
        client.delete(*keys)
