"""Prometheus metrics at ``/metrics``, computed at scrape time.

The web server, the Celery workers and beat are separate processes, so no in-process counter
would see the whole system. Every value is read from the database when Prometheus scrapes
(cheap, indexed queries over recent windows or small tables), except the tick-duration
histogram, whose cumulative counts are kept in Redis and advanced from the ``Tick`` rows.

Metrics (all prefixed ``dynarl_``):

``tick_duration_seconds`` (histogram)
    How long each scheduling tick took (``Tick.duration_ms``), cumulative since Redis was last
    emptied. A tick is counted once it is ``TICK_SETTLE_S`` old, so a tick still committing is
    never skipped; the histogram therefore lags real time by that much.
``decisions_total{policy,reason}`` (counter)
    Scheduling decisions ever made (``SchedulingDecision`` rows; one row per decision that moves
    GPUs, so the table stays small).
``migrations_total{strategy,outcome}`` (counter)
    Finished migrations by strategy (e.g. ``workload+p2p``) and outcome (committed, rolled_back,
    failed).
``migrations_in_flight{strategy,state}`` (gauge)
    Migrations planned, running or rolling back now.
``telemetry_samples_per_second`` (gauge)
    Worker telemetry samples ingested per second over the last ``TELEMETRY_RATE_WINDOW_S``
    (the ``samples`` of the downsampled ``TelemetrySample`` buckets in that window / its length).
``telemetry_reporting_workers`` (gauge)
    Workers that reported telemetry in that window.
``queue_length`` (gauge)
    Jobs pending admission.
``jobs{state}`` (gauge)
    Jobs by state, every state present.
``gpus{status,hardware}`` (gauge)
    Devices by status (free, allocated, lost) and hardware type.
``nodes{status}`` (gauge)
    Nodes by status (ready, lost, drained).
``node_heartbeat_age_seconds{node}`` (gauge)
    Seconds since each node's last heartbeat (since registration when it never sent one).
``alerts_open{kind}`` (gauge)
    Open anomaly alerts by kind, every kind present.

Access: only from ``METRICS_ALLOWED_IPS`` (the client address as ``TRUSTED_PROXIES`` lets it be
known), and with ``Authorization: Bearer <METRICS_TOKEN>`` when a token is set. By default, without
a token, that is this machine only (loopback); with a token, any address that presents it.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db.models import Count, Max, Min, Q, Sum
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from cluster.models import Device, Node, NodeStatus
from common import redis as common_redis
from common.api.errors import error_body
from common.net import address_in, client_ip
from jobs.models import Job, JobState
from scheduler.models import (
    OPEN_MIGRATION_STATES,
    Alert,
    AlertKind,
    Migration,
    MigrationState,
    SchedulingDecision,
    TelemetrySample,
    Tick,
)

log = logging.getLogger(__name__)

# Upper bounds in seconds; DynaRL's decisions take < 200 ms, so the resolution is there.
TICK_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TICK_SETTLE_S = 60.0  # a tick's transaction has committed (or vanished) this long after it started
TELEMETRY_RATE_WINDOW_S = 60.0
FINISHED_MIGRATION_STATES = (MigrationState.COMMITTED, MigrationState.ROLLED_BACK, MigrationState.FAILED)

REDIS_PREFIX = "dynarl:metrics:"
TICK_HWM_KEY = REDIS_PREFIX + "tick:hwm"  # id of the last Tick row counted
TICK_HIST_KEY = REDIS_PREFIX + "tick:histogram"  # le=<bound> / count / sum -> cumulative values


def _redis() -> redis.Redis:
    return common_redis.client_with_timeout(2.0)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bucket_field(bound: float) -> str:
    return f"le={bound}"


def advance_tick_histogram(client: redis.Redis, now: datetime) -> None:
    """Fold the Tick rows not yet counted (and old enough to be final) into the Redis totals.

    Optimistic: WATCH the high-water mark, so two scrapes racing count each row once; the loser
    leaves the work to the winner. The first scrape of a deployment reads every Tick row once;
    later ones read only the rows since the mark (by primary key).
    """
    cutoff = now - timedelta(seconds=TICK_SETTLE_S)
    with client.pipeline() as pipe:
        try:
            pipe.watch(TICK_HWM_KEY)  # type: ignore[no-untyped-call]  # Pipeline.watch has no hints
            raw_hwm = pipe.get(TICK_HWM_KEY)
            hwm = int(raw_hwm) if raw_hwm is not None else 0
            newest = Tick.objects.aggregate(newest=Max("pk"))["newest"] or 0
            if newest < hwm:
                # The database was replaced under us (restored, recreated): start counting over.
                pipe.multi()
                pipe.delete(TICK_HIST_KEY)
                pipe.set(TICK_HWM_KEY, 0)
                pipe.execute()
                return
            pending = Tick.objects.filter(pk__gt=hwm)
            # Count only rows older than TICK_SETTLE_S and stop at the first younger one: a tick
            # commits well within that (its own row, in one transaction), so every row below the
            # mark is visible and final, and a row that commits late is not jumped over.
            unsettled = pending.filter(started_at__gt=cutoff).aggregate(first=Min("pk"))["first"]
            if unsettled is not None:
                pending = pending.filter(pk__lt=unsettled)
            totals = pending.aggregate(
                last=Max("pk"),
                count=Count("pk"),
                sum_ms=Sum("duration_ms"),
                **{
                    f"b{i}": Count("pk", filter=Q(duration_ms__lte=b * 1000))
                    for i, b in enumerate(TICK_BUCKETS_S)
                },
            )
            if totals["last"] is None:
                pipe.unwatch()
                return
            pipe.multi()
            for i, bound in enumerate(TICK_BUCKETS_S):
                pipe.hincrby(TICK_HIST_KEY, _bucket_field(bound), totals[f"b{i}"])
            pipe.hincrby(TICK_HIST_KEY, "count", totals["count"])
            pipe.hincrbyfloat(TICK_HIST_KEY, "sum", (totals["sum_ms"] or 0.0) / 1000)
            pipe.set(TICK_HWM_KEY, totals["last"])
            pipe.execute()
        except redis.WatchError:
            return


def tick_histogram(now: datetime) -> HistogramMetricFamily | None:
    try:
        client = _redis()
        advance_tick_histogram(client, now)
        stored = {_text(k): _text(v) for k, v in client.hgetall(TICK_HIST_KEY).items()}
    except redis.RedisError:
        log.warning("tick histogram unavailable: Redis did not answer", exc_info=True)
        return None
    buckets = [(str(bound), float(stored.get(_bucket_field(bound), 0))) for bound in TICK_BUCKETS_S]
    buckets.append(("+Inf", float(stored.get("count", 0))))
    return HistogramMetricFamily(
        "dynarl_tick_duration_seconds",
        "Duration of scheduling ticks (counted once a minute old).",
        buckets=buckets,
        sum_value=float(stored.get("sum", 0.0)),
    )


def _gauge_by(name: str, documentation: str, label: str, counts: dict[str, int], keys: list[str]) -> Metric:
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for key in sorted(set(keys) | set(counts)):
        family.add_metric([key], counts.get(key, 0))
    return family


class ControlPlaneCollector:
    """Reads the current numbers from PostgreSQL (and Redis) on every scrape."""

    def collect(self) -> Iterator[Metric]:
        now = timezone.now()
        histogram = tick_histogram(now)
        if histogram is not None:
            yield histogram

        decisions = CounterMetricFamily(
            "dynarl_decisions", "Scheduling decisions made.", labels=["policy", "reason"]
        )
        for row in SchedulingDecision.objects.values("policy", "reason").annotate(n=Count("id")).order_by():
            decisions.add_metric([row["policy"], row["reason"]], row["n"])
        yield decisions

        finished = CounterMetricFamily(
            "dynarl_migrations",
            "Finished migrations by strategy and outcome.",
            labels=["strategy", "outcome"],
        )
        in_flight = GaugeMetricFamily(
            "dynarl_migrations_in_flight", "Migrations not finished yet.", labels=["strategy", "state"]
        )
        for row in Migration.objects.values("strategy", "state").annotate(n=Count("id")).order_by():
            if row["state"] in FINISHED_MIGRATION_STATES:
                finished.add_metric([row["strategy"], row["state"]], row["n"])
            elif row["state"] in OPEN_MIGRATION_STATES:
                in_flight.add_metric([row["strategy"], row["state"]], row["n"])
        yield finished
        yield in_flight

        recent = TelemetrySample.objects.filter(
            bucket_start__gte=now - timedelta(seconds=TELEMETRY_RATE_WINDOW_S)
        )
        ingest = recent.aggregate(samples=Sum("samples"), workers=Count("worker", distinct=True))
        yield GaugeMetricFamily(
            "dynarl_telemetry_samples_per_second",
            f"Telemetry samples ingested per second over the last {TELEMETRY_RATE_WINDOW_S:.0f} s.",
            value=(ingest["samples"] or 0) / TELEMETRY_RATE_WINDOW_S,
        )
        yield GaugeMetricFamily(
            "dynarl_telemetry_reporting_workers",
            f"Workers that reported telemetry in the last {TELEMETRY_RATE_WINDOW_S:.0f} s.",
            value=ingest["workers"],
        )

        jobs = {
            row["state"]: row["n"] for row in Job.objects.values("state").annotate(n=Count("id")).order_by()
        }
        yield GaugeMetricFamily(
            "dynarl_queue_length", "Jobs pending admission.", value=jobs.get(JobState.PENDING, 0)
        )
        yield _gauge_by("dynarl_jobs", "Jobs by state.", "state", jobs, list(JobState.values))

        gpus = GaugeMetricFamily(
            "dynarl_gpus", "GPUs by status and hardware type.", labels=["status", "hardware"]
        )
        for row in (
            Device.objects.values("status", "hardware").annotate(n=Count("id")).order_by("status", "hardware")
        ):
            gpus.add_metric([row["status"], row["hardware"]], row["n"])
        yield gpus

        nodes = {
            row["status"]: row["n"]
            for row in Node.objects.values("status").annotate(n=Count("id")).order_by()
        }
        yield _gauge_by("dynarl_nodes", "Nodes by status.", "status", nodes, list(NodeStatus.values))
        ages = GaugeMetricFamily(
            "dynarl_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat.", labels=["node"]
        )
        for name, last, registered in Node.objects.values_list("name", "last_heartbeat_at", "registered_at"):
            ages.add_metric([name], max(0.0, (now - (last or registered)).total_seconds()))
        yield ages

        alerts = {
            row["kind"]: row["n"]
            for row in Alert.objects.filter(cleared_at__isnull=True)
            .values("kind")
            .annotate(n=Count("id"))
            .order_by()
        }
        yield _gauge_by(
            "dynarl_alerts_open", "Open anomaly alerts by kind.", "kind", alerts, list(AlertKind.values)
        )


registry = CollectorRegistry(auto_describe=False)
registry.register(ControlPlaneCollector())


def _address_allowed(request: HttpRequest) -> bool:
    allowed: list[str] = settings.METRICS_ALLOWED_IPS
    return not allowed or address_in(client_ip(request), allowed)


def _authorised(request: HttpRequest) -> bool:
    expected: str | None = settings.METRICS_TOKEN
    if not expected:
        return True
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), expected.encode())


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _address_allowed(request):
        address = client_ip(request) or "a Unix socket"
        message = f"/metrics is not served to {address}; its address must be in METRICS_ALLOWED_IPS"
        return JsonResponse(error_body(403, "permission_denied", message), status=403)
    if not _authorised(request):
        body = error_body(401, "not_authenticated", "send Authorization: Bearer <METRICS_TOKEN>")
        response = JsonResponse(body, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
