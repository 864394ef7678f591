"""Anomaly alerts, as AReaL's monitoring raises them: a worker idle while its group works, a
job's throughput collapsing, a node going quiet.

Detection reads only the database (``TelemetrySample`` history, ``Worker``, ``Job``, ``Node``
rows), so it runs anywhere and is tested with rows. Each run computes the set of anomalies that
hold *now*; an anomaly without an open alert raises one, an open alert whose anomaly no longer
holds is cleared. Raising and clearing each write the ``Alert`` row, an AuditEvent by the
``monitor`` system actor and a live ``alert`` event (to the job's page and the cluster view).

The kinds (thresholds from settings, ``ALERT_*``):

``worker_stuck`` (subject ``worker:<name>``)
    A running worker whose every telemetry bucket over the last ``ALERT_STUCK_WINDOW_S`` (and
    its latest reported utilisation) is at or under ``ALERT_STUCK_UTILISATION``, while the
    other workers of its group average at least ``ALERT_GROUP_BUSY_UTILISATION`` over the same
    window. The worker must have reported across the window (its first bucket in the window no
    later than one and a half buckets after the window opens) and still be reporting (a bucket
    in the last two), so a worker that just started or went silent is not "stuck": silence is
    the heartbeat alert's business. Clears when it works again, stops, or its group idles too.
``throughput_collapse`` (subject ``job:<id>``)
    The job's tokens/s over the last ``ALERT_COLLAPSE_WINDOW_S`` fall under
    ``ALERT_COLLAPSE_FRACTION`` of the median of the window-long rates before it, over
    ``ALERT_COLLAPSE_HISTORY_S`` (at least ``MIN_BASELINE_WINDOWS`` windows with telemetry).
    Rates are averaged over whole windows because a trainer's tokens come in bursts, once per
    step. The job's throughput is its trainer's tokens (its rollouts' when it has no trainer),
    as the scheduling tick counts it. While the alert is open the baseline stays the one before
    the collapse, and the alert clears only when the rate is back to
    ``ALERT_RECOVERED_FRACTION`` of it (hysteresis: no flapping around one threshold).
``heartbeat_gap`` (subject ``node:<name>``)
    A node whose last heartbeat (its registration, if it never sent one) is older than
    ``ALERT_HEARTBEAT_GAP_S``, which is shorter than ``NODE_LOST_AFTER_S``: operators hear of
    the gap before the node is declared lost. Nodes already lost raise none (being lost has its
    own record); an open one stays open until the node heartbeats again.

Runs are serialised by a transaction-scoped advisory lock, so overlapping beat deliveries never
race on the one-open-alert-per-kind-and-subject constraint.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Avg, Max, Min, Q, Sum
from django.utils import timezone

from cluster.models import Device, Node, NodeStatus
from common import audit, events
from common.audit import Actor
from jobs.models import Job, JobState, Worker, WorkerGroup, WorkerState
from scheduler.models import Alert, AlertKind, TelemetrySample

MONITOR = Actor.system("monitor")
MIN_BASELINE_WINDOWS = 3
WATCHED_JOB_STATES = (JobState.RUNNING, JobState.PAUSED_SCHEDULING)
_ADVISORY_LOCK_KEY = 0x64796E61_616C7274  # "dyna" "alrt": any constant no other code uses


@dataclass(frozen=True)
class Thresholds:
    stuck_window_s: float
    stuck_utilisation: float
    group_busy_utilisation: float
    collapse_window_s: float
    collapse_history_s: float
    collapse_fraction: float
    recovered_fraction: float
    heartbeat_gap_s: float
    bucket_s: float

    @classmethod
    def from_settings(cls) -> Thresholds:
        return cls(
            stuck_window_s=settings.ALERT_STUCK_WINDOW_S,
            stuck_utilisation=settings.ALERT_STUCK_UTILISATION,
            group_busy_utilisation=settings.ALERT_GROUP_BUSY_UTILISATION,
            collapse_window_s=settings.ALERT_COLLAPSE_WINDOW_S,
            collapse_history_s=settings.ALERT_COLLAPSE_HISTORY_S,
            collapse_fraction=settings.ALERT_COLLAPSE_FRACTION,
            recovered_fraction=settings.ALERT_RECOVERED_FRACTION,
            heartbeat_gap_s=settings.ALERT_HEARTBEAT_GAP_S,
            bucket_s=settings.TELEMETRY_BUCKET_S,
        )


@dataclass(frozen=True)
class Anomaly:
    kind: AlertKind
    subject: str
    message: str
    job_id: int | None = None
    node_id: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.subject)


@dataclass
class DetectionResult:
    raised: list[Alert] = field(default_factory=list)
    cleared: list[Alert] = field(default_factory=list)
    open: int = 0
    skipped: bool = False  # another run held the lock


# --- worker stuck at zero while its group is busy ---------------------------------------------


def find_stuck_workers(now: datetime, t: Thresholds) -> list[Anomaly]:
    opened = now - timedelta(seconds=t.stuck_window_s)
    per_worker = list(
        TelemetrySample.objects.filter(bucket_start__gte=opened, job__state__in=WATCHED_JOB_STATES)
        .values("job_id", "group", "worker")
        .annotate(
            first=Min("bucket_start"),
            last=Max("bucket_start"),
            peak=Max("utilisation_mean"),
            mean=Avg("utilisation_mean"),
        )
        .order_by()
    )
    live = {
        w.name: w
        for w in Worker.objects.filter(name__in=[r["worker"] for r in per_worker], state=WorkerState.RUNNING)
    }
    by_group: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in per_worker:
        if row["worker"] in live:
            by_group[(row["job_id"], row["group"])].append(row)

    covered_by = opened + timedelta(seconds=1.5 * t.bucket_s)
    reporting_since = now - timedelta(seconds=2 * t.bucket_s)
    candidates: list[tuple[dict[str, Any], float]] = []
    for rows in by_group.values():
        for row in rows:
            worker = live[row["worker"]]
            idle = (
                row["peak"] <= t.stuck_utilisation
                and worker.utilisation <= t.stuck_utilisation
                and row["first"] <= covered_by
                and row["last"] >= reporting_since
            )
            if not idle:
                continue
            others = [r["mean"] for r in rows if r is not row]
            if others and statistics.fmean(others) >= t.group_busy_utilisation:
                candidates.append((row, statistics.fmean(others)))

    nodes = dict(
        Device.objects.filter(worker__name__in=[row["worker"] for row, _ in candidates])
        .values_list("worker__name", "node_id")
        .order_by("node_id")
    )
    return [
        Anomaly(
            AlertKind.WORKER_STUCK,
            f"worker:{row['worker']}",
            f"worker {row['worker']} of group {row['group']} has been at {row['peak'] * 100:.0f}% utilisation "
            f"or less for {t.stuck_window_s:.0f} s while the rest of its group averages {group_mean * 100:.0f}%",
            job_id=row["job_id"],
            node_id=nodes.get(row["worker"]),
        )
        for row, group_mean in candidates
    ]


# --- a job's throughput collapsing ------------------------------------------------------------


def throughput_groups(groups: Iterable[WorkerGroup]) -> list[str]:
    """The groups whose tokens are the job's throughput (as ``scheduler.services.tick`` counts it)."""
    groups = list(groups)
    actors = [g.name for g in groups if g.kind == "actor"]
    return actors or [g.name for g in groups if g.kind == "rollout"]


@dataclass(frozen=True)
class ThroughputWindows:
    recent: float  # tokens/s over the latest window
    baseline: float | None  # median tokens/s of the earlier windows; None without enough of them


def throughput_windows(
    job: Job, group_names: list[str], now: datetime, baseline_end: datetime, t: Thresholds
) -> ThroughputWindows:
    """Window-long token rates: the latest window ending now, and the median of those before
    ``baseline_end - window`` going back ``collapse_history_s`` (only windows with telemetry)."""
    window = timedelta(seconds=t.collapse_window_s)
    recent_from = now - window
    base_to = min(baseline_end, now) - window
    base_from = base_to - timedelta(seconds=t.collapse_history_s - t.collapse_window_s)
    rows = (
        TelemetrySample.objects.filter(job=job, group__in=group_names)
        .filter(Q(bucket_start__gte=recent_from) | Q(bucket_start__gte=base_from, bucket_start__lt=base_to))
        .values("bucket_start")
        .annotate(tokens=Sum("tokens"))
        .order_by()
    )
    recent_tokens = 0
    windows: dict[int, int] = {}
    for row in rows:
        if row["bucket_start"] >= recent_from:
            recent_tokens += row["tokens"]
        else:
            index = int((base_to - row["bucket_start"]) / window)
            windows[index] = windows.get(index, 0) + row["tokens"]
    rates = [tokens / t.collapse_window_s for tokens in windows.values()]
    baseline = statistics.median(rates) if len(rates) >= MIN_BASELINE_WINDOWS else None
    return ThroughputWindows(recent=recent_tokens / t.collapse_window_s, baseline=baseline)


def find_throughput_collapses(
    now: datetime, t: Thresholds, open_since: Mapping[str, datetime]
) -> list[Anomaly]:
    """``open_since``: subject -> raised_at of the open collapse alerts (their baseline is frozen)."""
    found = []
    jobs = Job.objects.filter(state__in=WATCHED_JOB_STATES).prefetch_related("groups")
    for job in jobs:
        subject = f"job:{job.pk}"
        names = throughput_groups(job.groups.all())
        if not names:
            continue
        raised_at = open_since.get(subject)
        rates = throughput_windows(job, names, now, raised_at or now, t)
        if rates.baseline is None or rates.baseline <= 0:
            continue
        fraction = t.recovered_fraction if raised_at else t.collapse_fraction
        if rates.recent < fraction * rates.baseline:
            found.append(
                Anomaly(
                    AlertKind.THROUGHPUT_COLLAPSE,
                    subject,
                    f"job {job.pk} ({job.name}) makes {rates.recent:.0f} tokens/s over the last "
                    f"{t.collapse_window_s:.0f} s, {rates.recent / rates.baseline * 100:.0f}% of its recent "
                    f"median of {rates.baseline:.0f} tokens/s",
                    job_id=job.pk,
                )
            )
    return found


# --- heartbeat gaps ---------------------------------------------------------------------------


def find_heartbeat_gaps(now: datetime, t: Thresholds, open_subjects: set[str]) -> list[Anomaly]:
    stale = now - timedelta(seconds=t.heartbeat_gap_s)
    silent = Node.objects.filter(
        Q(last_heartbeat_at__lt=stale) | Q(last_heartbeat_at__isnull=True, registered_at__lt=stale)
    )
    found = []
    for node in silent:
        subject = f"node:{node.name}"
        if node.status == NodeStatus.LOST and subject not in open_subjects:
            continue
        since = node.last_heartbeat_at or node.registered_at
        found.append(
            Anomaly(
                AlertKind.HEARTBEAT_GAP,
                subject,
                f"node {node.name} has sent no heartbeat for {(now - since).total_seconds():.0f} s "
                f"(alert after {t.heartbeat_gap_s:.0f} s, lost after {settings.NODE_LOST_AFTER_S:.0f} s)",
                node_id=node.pk,
            )
        )
    return found


# --- raising and clearing ---------------------------------------------------------------------


def alert_json(alert: Alert) -> dict[str, Any]:
    return {
        "id": alert.pk,
        "kind": alert.kind,
        "subject": alert.subject,
        "job": alert.job_id,
        "node": alert.node_id,
        "message": alert.message,
        "raised_at": alert.raised_at.isoformat(),
        "cleared_at": alert.cleared_at.isoformat() if alert.cleared_at else None,
    }


def alert_event(alert: Alert, state: str) -> dict[str, Any]:
    return {**alert_json(alert), "state": state}


def _raise(anomaly: Anomaly, now: datetime) -> Alert:
    alert = Alert.objects.create(
        kind=anomaly.kind,
        subject=anomaly.subject,
        job_id=anomaly.job_id,
        node_id=anomaly.node_id,
        message=anomaly.message,
        raised_at=now,
    )
    audit.record(
        MONITOR,
        "alert.raise",
        alert,
        job=alert.job,
        reason=anomaly.message,
        payload={"kind": anomaly.kind, "subject": anomaly.subject},
    )
    events.publish("alert", alert_event(alert, "raised"), job_id=alert.job_id, cluster=True)
    return alert


def _clear(alert: Alert, now: datetime) -> Alert:
    alert.cleared_at = now
    alert.save(update_fields=["cleared_at"])
    open_for = (now - alert.raised_at).total_seconds()
    audit.record(
        MONITOR,
        "alert.clear",
        alert,
        job=alert.job,
        reason=f"no longer holds, after {open_for:.0f} s open",
        payload={"kind": alert.kind, "subject": alert.subject},
    )
    events.publish("alert", alert_event(alert, "cleared"), job_id=alert.job_id, cluster=True)
    return alert


def _locked() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_ADVISORY_LOCK_KEY])
        row = cursor.fetchone()
    return bool(row and row[0])


def run_detection(*, now: datetime | None = None, thresholds: Thresholds | None = None) -> DetectionResult:
    """Raise alerts for new anomalies and clear those that recovered, in one transaction."""
    now = now or timezone.now()
    t = thresholds or Thresholds.from_settings()
    result = DetectionResult()
    with transaction.atomic():
        if not _locked():
            result.skipped = True
            return result
        open_alerts = {(a.kind, a.subject): a for a in Alert.objects.filter(cleared_at__isnull=True)}
        collapse_open = {
            s: a.raised_at for (k, s), a in open_alerts.items() if k == AlertKind.THROUGHPUT_COLLAPSE
        }
        gap_open = {s for (k, s) in open_alerts if k == AlertKind.HEARTBEAT_GAP}
        anomalies = {
            a.key: a
            for a in (
                *find_stuck_workers(now, t),
                *find_throughput_collapses(now, t, collapse_open),
                *find_heartbeat_gaps(now, t, gap_open),
            )
        }
        for key, anomaly in anomalies.items():
            if key not in open_alerts:
                result.raised.append(_raise(anomaly, now))
        for key, alert in open_alerts.items():
            if key not in anomalies:
                result.cleared.append(_clear(alert, now))
        result.open = len(anomalies)
    return result
