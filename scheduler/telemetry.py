"""Telemetry ingest: node heartbeats in, the live window, latest values and downsampled history out.

One heartbeat of one node carries per-device readings and per-worker samples. Ingest does, per
heartbeat, a fixed number of statements however many devices and workers it carries:

- the **live window**: every worker sample goes into a Redis sorted set per job (score = sample
  time), trimmed to ``TELEMETRY_LIVE_WINDOW_S`` and capped at ``TELEMETRY_LIVE_MAX_SAMPLES``; the
  scheduling tick reads it with :func:`recent_samples`;
- **latest values**: ``Device.utilisation/memory_used_gb/reported_at`` and ``Worker.utilisation``
  in one ``UPDATE ... FROM (VALUES ...)`` each;
- **history**: one ``TelemetrySample`` row per worker per ``TELEMETRY_BUCKET_S`` bucket, upserted
  with ``INSERT ... ON CONFLICT DO UPDATE`` that folds the new samples into the bucket's running
  mean, minimum and token sum; :func:`prune` deletes rows older than ``TELEMETRY_RETENTION_HOURS``.

Clocks: agents stamp samples with their own clock and the heartbeat with ``sent_at``; the server
shifts every sample by ``now - sent_at``, so a skewed agent clock never pushes samples out of the
window. Repeats: a heartbeat whose ``sent_at`` is not newer than the node's last accepted one is a
retransmission and changes nothing (an agent sends one heartbeat at a time).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Model
from django.utils import timezone

from cluster.models import Device, Node
from common import redis as common_redis
from jobs.models import Worker, WorkerGroup, WorkerState
from scheduler.core.signals import WorkerSample
from scheduler.models import TelemetrySample

KEY_PREFIX = "dynarl:telemetry"
# Samples further back than this (after clock correction) are dropped: an agent that buffered
# telemetry while cut off sends it late, but an hour-old reading helps neither the tick nor history.
MAX_SAMPLE_AGE_S = 3600.0
# A ``sent_at`` this far behind the last accepted one means the agent's clock was reset, not a
# retransmission; the heartbeat is accepted and becomes the new reference.
CLOCK_RESET_S = 60.0
# Workers that still run code (and so still report) on a node.
REPORTING_WORKER_STATES = (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.STOPPING)
PRUNE_BATCH_ROWS = 10_000
# A time-sharing (colocated) worker's part in its turn-taking, as its samples may say (informational).
WORKER_TURNS = ("active", "onloading", "offloaded")
# What measured a device reading (devices[].source); absent from older agents.
DEVICE_SOURCES = ("nvml", "process_cpu", "simulated")


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


class TelemetryError(ValueError):
    """A malformed heartbeat; ``errors`` names every field at fault. Nothing was written."""

    def __init__(self, errors: Iterable[FieldError]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{e.path}: {e.message}" for e in self.errors))


@dataclass(frozen=True)
class DeviceReading:
    index: int
    utilisation: float
    memory_used_gb: float
    source: str = ""


@dataclass(frozen=True)
class WorkerReading:
    worker: str
    at: float  # server clock, epoch seconds
    utilisation: float
    queue_length: int
    in_flight: int
    tokens: int
    progress: float | None
    waiting: float | None = None


@dataclass(frozen=True)
class Heartbeat:
    sent_at: float  # the agent's clock
    offset_s: float  # server clock minus agent clock, applied to every sample
    devices: tuple[DeviceReading, ...]
    workers: tuple[WorkerReading, ...]


@dataclass
class IngestResult:
    accepted_devices: int = 0
    accepted_samples: int = 0
    duplicate: bool = False
    rejected: list[dict[str, Any]] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return self.accepted_devices + self.accepted_samples

    def to_json(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "accepted_devices": self.accepted_devices,
            "accepted_samples": self.accepted_samples,
            "duplicate": self.duplicate,
            "rejected": self.rejected,
        }


# --- parsing ---------------------------------------------------------------------------------------


def _number(
    value: Any, path: str, errors: list[FieldError], *, low: float, high: float | None = None
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        errors.append(FieldError(path, "must be a number"))
        return 0.0
    if value < low or (high is not None and value > high):
        bound = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
        errors.append(FieldError(path, f"must be {bound}"))
    return float(value)


def _count(value: Any, path: str, errors: list[FieldError]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        errors.append(FieldError(path, "must be an integer"))
        return 0
    if value < 0:
        errors.append(FieldError(path, "must be at least 0"))
    return int(value)


def _list(payload: Mapping[str, Any], key: str, errors: list[FieldError]) -> list[Any]:
    value = payload.get(key, [])
    if not isinstance(value, list):
        errors.append(FieldError(key, "must be a list"))
        return []
    return value


def parse_heartbeat(payload: Any, now: float) -> Heartbeat:
    """Validate a heartbeat body; raises TelemetryError naming each bad field."""
    if not isinstance(payload, Mapping):
        raise TelemetryError([FieldError("", "must be a JSON object")])
    errors: list[FieldError] = []
    sent_at = _number(payload.get("sent_at"), "sent_at", errors, low=0.0)
    offset = now - sent_at
    devices: list[DeviceReading] = []
    seen_indices: set[int] = set()
    for i, item in enumerate(_list(payload, "devices", errors)):
        path = f"devices[{i}]"
        if not isinstance(item, Mapping):
            errors.append(FieldError(path, "must be an object"))
            continue
        index = _count(item.get("index"), f"{path}.index", errors)
        if index in seen_indices:
            errors.append(FieldError(f"{path}.index", f"device {index} is listed twice"))
        seen_indices.add(index)
        source = item.get("source", "")
        if source != "" and source not in DEVICE_SOURCES:
            errors.append(
                FieldError(f"{path}.source", f"must be one of {', '.join(DEVICE_SOURCES)} or absent")
            )
        devices.append(
            DeviceReading(
                index=index,
                utilisation=_number(
                    item.get("utilisation"), f"{path}.utilisation", errors, low=0.0, high=1.0
                ),
                memory_used_gb=_number(
                    item.get("memory_used_gb", 0.0), f"{path}.memory_used_gb", errors, low=0.0
                ),
                source=str(source),
            )
        )
    workers: list[WorkerReading] = []
    for i, item in enumerate(_list(payload, "workers", errors)):
        path = f"workers[{i}]"
        if not isinstance(item, Mapping):
            errors.append(FieldError(path, "must be an object"))
            continue
        name = item.get("worker")
        if not isinstance(name, str) or not name:
            errors.append(FieldError(f"{path}.worker", "must be a non-empty string"))
            name = ""
        at = _number(item.get("at", sent_at), f"{path}.at", errors, low=0.0)
        if at > sent_at + 1.0:
            errors.append(FieldError(f"{path}.at", "is later than the heartbeat's sent_at"))
        progress = item.get("progress")
        waiting = item.get("waiting")
        turn = item.get("turn")
        if turn is not None and turn not in WORKER_TURNS:
            errors.append(FieldError(f"{path}.turn", f"must be one of {', '.join(WORKER_TURNS)} or absent"))
        workers.append(
            WorkerReading(
                worker=name,
                at=at + offset,
                utilisation=_number(
                    item.get("utilisation"), f"{path}.utilisation", errors, low=0.0, high=1.0
                ),
                queue_length=_count(item.get("queue_length", 0), f"{path}.queue_length", errors),
                in_flight=_count(item.get("in_flight", 0), f"{path}.in_flight", errors),
                tokens=_count(item.get("tokens", 0), f"{path}.tokens", errors),
                progress=None
                if progress is None
                else _number(progress, f"{path}.progress", errors, low=0.0, high=1.0),
                waiting=None
                if waiting is None
                else _number(waiting, f"{path}.waiting", errors, low=0.0, high=1.0),
            )
        )
    if errors:
        raise TelemetryError(errors)
    return Heartbeat(sent_at=sent_at, offset_s=offset, devices=tuple(devices), workers=tuple(workers))


# --- Redis -----------------------------------------------------------------------------------------


def window_key(job_id: int) -> str:
    return f"{KEY_PREFIX}:job:{job_id}"


def _heartbeat_key(node_id: int) -> str:
    return f"{KEY_PREFIX}:sent:{node_id}"


# Accept a heartbeat only when its sent_at is newer than the last accepted one (or far older: the
# agent's clock was reset). Returns {1, previous} when accepted, {0, previous} for a repeat.
_CLAIM_HEARTBEAT = """
local previous = redis.call('GET', KEYS[1])
local sent_at = tonumber(ARGV[1])
if previous and sent_at <= tonumber(previous) and sent_at > tonumber(previous) - tonumber(ARGV[2]) then
  return {0, previous}
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', 86400)
return {1, previous or ''}
"""
# Undo a claim whose database writes failed, unless a later heartbeat has claimed since.
_RELEASE_HEARTBEAT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'EX', 86400) end
end
return 0
"""


def _claim_heartbeat(node_id: int, sent_at: float) -> tuple[bool, str]:
    fresh, previous = common_redis.shared_client().eval(
        _CLAIM_HEARTBEAT, 1, _heartbeat_key(node_id), repr(sent_at), repr(CLOCK_RESET_S)
    )
    return bool(fresh), previous.decode() if isinstance(previous, bytes) else str(previous)


def _release_heartbeat(node_id: int, sent_at: float, previous: str) -> None:
    common_redis.shared_client().eval(_RELEASE_HEARTBEAT, 1, _heartbeat_key(node_id), repr(sent_at), previous)


def forget_node(node_id: int) -> None:
    """A (re-)registered agent starts a new sequence of heartbeats."""
    common_redis.shared_client().delete(_heartbeat_key(node_id))


def _encode(group: str, sample: WorkerReading) -> str:
    return json.dumps(
        [
            group,
            sample.worker,
            round(sample.at, 6),
            sample.utilisation,
            sample.queue_length,
            sample.in_flight,
            sample.tokens,
            sample.progress,
        ],
        separators=(",", ":"),
    )


def _push_window(samples_by_job: Mapping[int, Mapping[str, float]], now: float) -> None:
    horizon = now - settings.TELEMETRY_LIVE_WINDOW_S
    keep = settings.TELEMETRY_LIVE_MAX_SAMPLES
    ttl = max(1, math.ceil(settings.TELEMETRY_LIVE_WINDOW_S * 2))
    pipe = common_redis.shared_client().pipeline(transaction=False)
    for job_id, members in samples_by_job.items():
        key = window_key(job_id)
        pipe.zadd(key, dict(members))
        pipe.zremrangebyscore(key, "-inf", horizon)
        pipe.zremrangebyrank(key, 0, -(keep + 1))
        pipe.expire(key, ttl)
    pipe.execute()


def recent_samples(job_id: int, since_epoch_s: float) -> list[WorkerSample]:
    """The job's worker samples after ``since_epoch_s`` (server clock), oldest first."""
    raw = cast(
        list[bytes],
        common_redis.shared_client().zrangebyscore(window_key(job_id), f"({since_epoch_s!r}", "+inf"),
    )
    samples = []
    for member in raw:
        group, worker, at, utilisation, queue_length, in_flight, tokens, progress = json.loads(member)
        samples.append(
            WorkerSample(
                group_id=group,
                worker_id=worker,
                at=at,
                utilisation=utilisation,
                queue_length=queue_length,
                in_flight=in_flight,
                tokens=tokens,
                progress=progress,
            )
        )
    return samples


# --- ingest ----------------------------------------------------------------------------------------


def _table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def _json(rows: Any) -> str:
    return json.dumps(rows, separators=(",", ":"))


@dataclass
class _Bucket:
    """The samples of one worker in one TELEMETRY_BUCKET_S bucket, folded."""

    samples: int = 0
    utilisation_sum: float = 0.0
    utilisation_min: float = math.inf
    tokens: int = 0
    last_at: float = -math.inf
    queue_length: int = 0
    in_flight: int = 0
    waiting_sum: float = 0.0
    waiting_samples: int = 0

    @property
    def waiting_mean(self) -> float | None:
        return self.waiting_sum / self.waiting_samples if self.waiting_samples else None

    def add(self, sample: WorkerReading) -> None:
        self.samples += 1
        if sample.waiting is not None:
            self.waiting_sum += sample.waiting
            self.waiting_samples += 1
        self.utilisation_sum += sample.utilisation
        self.utilisation_min = min(self.utilisation_min, sample.utilisation)
        self.tokens += sample.tokens
        if sample.at >= self.last_at:
            self.last_at = sample.at
            self.queue_length = sample.queue_length
            self.in_flight = sample.in_flight


def bucket_start(at: float) -> float:
    width = settings.TELEMETRY_BUCKET_S
    return math.floor(at / width) * width


@functools.cache
def _ingest_sql() -> str:
    """One statement for a whole heartbeat (PostgreSQL runs every data-modifying CTE exactly once,
    atomically): latest device readings, the node's known reporting workers, their latest
    utilisation, and the per-bucket upsert that folds new samples into the running mean, minimum
    and token sum. Rows come as JSON documents, so the text is the same for any number of rows and
    the driver binds a few strings instead of one parameter per value. It answers with the node's
    device indices the readings were for and the workers recognised, as [name, group, job id]."""
    colocated = Worker.colocated_devices.through
    device, worker, group, sample = (
        _table(Device),
        _table(Worker),
        _table(WorkerGroup),
        _table(TelemetrySample),
    )
    return f"""
WITH device_in AS (
    SELECT * FROM json_to_recordset(%(devices)s::json) AS v(i integer, u double precision, m double precision, s text)
), devices_known AS (
    SELECT d.id, d.index FROM {device} d WHERE d.node_id = %(node)s AND d.index IN (SELECT i FROM device_in)
), device_rows AS (
    -- Readings are latest values: a row another transaction holds (a device changing owner, a
    -- job releasing it) is skipped this once rather than waited for, so the ingest never joins
    -- a lock cycle with those transactions. The same goes for the workers below.
    SELECT d.id FROM {device} d WHERE d.id IN (SELECT id FROM devices_known) FOR NO KEY UPDATE SKIP LOCKED
), devices_updated AS (
    UPDATE {device} AS d SET utilisation = v.u, memory_used_gb = v.m, reading_source = v.s,
        reported_at = %(reported_at)s
    FROM device_in v WHERE d.node_id = %(node)s AND d.index = v.i AND d.id IN (SELECT id FROM device_rows)
), known AS (
    -- workers that run on this node: they own, or share, one of its devices
    SELECT w.id, w.name, g.name AS grp, g.job_id
    FROM {worker} w JOIN {group} g ON g.id = w.group_id
    WHERE w.name IN (SELECT json_array_elements_text(%(names)s::json)) AND w.state = ANY(%(states)s)
      AND (EXISTS (SELECT 1 FROM {device} d WHERE d.worker_id = w.id AND d.node_id = %(node)s)
           OR EXISTS (SELECT 1 FROM {_table(colocated)} c JOIN {device} d ON d.id = c.device_id
                      WHERE c.worker_id = w.id AND d.node_id = %(node)s))
), latest AS (
    SELECT * FROM json_to_recordset(%(latest)s::json) AS v(worker text, u double precision)
), worker_rows AS (
    SELECT w.id FROM {worker} w WHERE w.id IN (SELECT id FROM known) FOR NO KEY UPDATE SKIP LOCKED
), workers_updated AS (
    UPDATE {worker} AS w SET utilisation = v.u FROM latest v JOIN known k ON k.name = v.worker
    WHERE w.id = k.id AND w.id IN (SELECT id FROM worker_rows)
), bucket_in AS (
    SELECT * FROM json_to_recordset(%(buckets)s::json) AS v(
        worker text, start double precision, n integer, mean double precision, low double precision,
        tokens bigint, q integer, f integer, w double precision)
), history AS (
    INSERT INTO {sample} AS t (job_id, "group", worker, node_id, bucket_start, samples, utilisation_mean,
                               utilisation_min, tokens, queue_length, in_flight, waiting_mean)
    SELECT k.job_id, k.grp, b.worker, %(node)s, to_timestamp(b.start), b.n, b.mean, b.low, b.tokens, b.q, b.f,
           b.w
    FROM bucket_in b JOIN known k ON k.name = b.worker
    ON CONFLICT (worker, bucket_start) DO UPDATE SET
        utilisation_mean = (t.utilisation_mean * t.samples + EXCLUDED.utilisation_mean * EXCLUDED.samples)
                           / (t.samples + EXCLUDED.samples),
        utilisation_min = LEAST(t.utilisation_min, EXCLUDED.utilisation_min),
        waiting_mean = CASE
            WHEN t.waiting_mean IS NULL THEN EXCLUDED.waiting_mean
            WHEN EXCLUDED.waiting_mean IS NULL THEN t.waiting_mean
            ELSE (t.waiting_mean * t.samples + EXCLUDED.waiting_mean * EXCLUDED.samples)
                 / (t.samples + EXCLUDED.samples)
        END,
        samples = t.samples + EXCLUDED.samples,
        tokens = t.tokens + EXCLUDED.tokens,
        queue_length = EXCLUDED.queue_length,
        in_flight = EXCLUDED.in_flight,
        job_id = EXCLUDED.job_id,
        "group" = EXCLUDED."group",
        node_id = EXCLUDED.node_id
)
SELECT (SELECT coalesce(json_agg(index), '[]') FROM devices_known),
       (SELECT coalesce(json_agg(json_build_array(name, grp, job_id)), '[]') FROM known)
"""


def _write(
    node: Node,
    beat: Heartbeat,
    workers: list[WorkerReading],
    now: float,
) -> tuple[set[int], dict[str, tuple[str, int]]]:
    """Run the ingest statement; returns the node's device indices the readings were for (each
    applied, or skipped this once while another transaction holds the row) and the recognised
    workers as name -> (group, job id)."""
    latest: dict[str, WorkerReading] = {}
    buckets: dict[tuple[str, float], _Bucket] = defaultdict(_Bucket)
    for sample in workers:
        if sample.worker not in latest or sample.at >= latest[sample.worker].at:
            latest[sample.worker] = sample
        buckets[(sample.worker, bucket_start(sample.at))].add(sample)
    params: dict[str, Any] = {
        "node": node.pk,
        "reported_at": datetime.fromtimestamp(now, tz=UTC),
        "devices": _json(
            [{"i": d.index, "u": d.utilisation, "m": d.memory_used_gb, "s": d.source} for d in beat.devices]
        ),
        "names": _json(sorted(latest)),
        "states": [str(state) for state in REPORTING_WORKER_STATES],
        "latest": _json([{"worker": name, "u": s.utilisation} for name, s in latest.items()]),
        "buckets": _json(
            [
                {
                    "worker": name,
                    "start": start,
                    "n": b.samples,
                    "mean": b.utilisation_sum / b.samples,
                    "low": b.utilisation_min,
                    "tokens": b.tokens,
                    "q": b.queue_length,
                    "f": b.in_flight,
                    "w": b.waiting_mean,
                }
                for (name, start), b in buckets.items()
            ]
        ),
    }
    with connection.cursor() as cursor:
        cursor.execute(_ingest_sql(), params)
        row = cursor.fetchone()
    assert row is not None
    devices, known = (json.loads(v) if isinstance(v, str) else v for v in row)
    return set(devices), {name: (group, job_id) for name, group, job_id in known}


def ingest_report(node: Node, payload: Any, *, now: float | None = None) -> IngestResult:
    """Ingest one heartbeat of ``node``; raises TelemetryError (nothing written) when malformed."""
    now = time.time() if now is None else now
    return ingest_heartbeat(node, parse_heartbeat(payload, now), now=now)


def ingest_heartbeat(node: Node, beat: Heartbeat, *, now: float) -> IngestResult:
    """Ingest a parsed heartbeat (``now`` as given to parse_heartbeat).

    The database writes are one statement (atomic on its own, or part of the caller's
    transaction); the live window is written once they commit, so the tick never reads samples
    that were rolled back.
    """
    result = IngestResult()
    fresh, previous = _claim_heartbeat(node.pk, beat.sent_at)
    if not fresh:
        result.duplicate = True
        return result
    oldest = now - MAX_SAMPLE_AGE_S
    recent = [s for s in beat.workers if s.at >= oldest]
    result.rejected += [
        {"worker": s.worker, "reason": "sample too old"} for s in beat.workers if s.at < oldest
    ]
    try:
        updated, known = _write(node, beat, recent, now)
    except BaseException:
        _release_heartbeat(node.pk, beat.sent_at, previous)
        raise
    result.accepted_devices = len(updated)
    result.rejected[:0] = [
        {"device": d.index, "reason": "no such device on this node"}
        for d in beat.devices
        if d.index not in updated
    ]
    window: dict[int, dict[str, float]] = defaultdict(dict)
    for sample in recent:
        found = known.get(sample.worker)
        if found is None:
            result.rejected.append({"worker": sample.worker, "reason": "not a live worker on this node"})
            continue
        group, job_id = found
        result.accepted_samples += 1
        window[job_id][_encode(group, sample)] = sample.at
    if window:
        transaction.on_commit(lambda: _push_window(window, now))
    return result


def ingest(node: Node, payload: Any) -> int:
    """Ingest one heartbeat of ``node``; returns the samples accepted (device readings + worker samples)."""
    return ingest_report(node, payload).accepted


# --- retention -------------------------------------------------------------------------------------


def prune(now: datetime | None = None) -> int:
    """Delete history older than TELEMETRY_RETENTION_HOURS, in batches; returns the rows deleted."""
    cutoff = (now or timezone.now()) - timedelta(hours=settings.TELEMETRY_RETENTION_HOURS)
    deleted = 0
    while True:
        batch = list(
            TelemetrySample.objects.filter(bucket_start__lt=cutoff).values_list("pk", flat=True)[
                :PRUNE_BATCH_ROWS
            ]
        )
        if not batch:
            return deleted
        count, _ = TelemetrySample.objects.filter(pk__in=batch).delete()
        deleted += count
