"""/metrics: parses as Prometheus text, and its numbers follow the rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from pytest_django import Settings

from cluster.models import DeviceStatus, NodeStatus
from controlplane import metrics
from jobs.models import JobState
from scheduler.models import Alert, AlertKind, Migration, SchedulingDecision, Tick
from tests.live.conftest import allocate, make_group, make_job, make_node, make_user, make_worker

pytestmark = pytest.mark.django_db

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(autouse=True)
def fresh_tick_counters() -> Iterator[None]:
    """The histogram's totals live in Redis, which outlives each test's rolled-back rows."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(metrics.TICK_HWM_KEY, metrics.TICK_HIST_KEY)
    yield
    client.delete(metrics.TICK_HWM_KEY, metrics.TICK_HIST_KEY)


def scrape(client: Client, **headers: str) -> Samples:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_tick_duration_histogram_counts_each_settled_tick_once(client: Client) -> None:
    job = make_job(make_user("op", "operator"))
    old = timezone.now() - timedelta(minutes=2)

    def tick(ms: float, at: object = old) -> Tick:
        return Tick.objects.create(job=job, started_at=at, duration_ms=ms, outcome="no_change")

    for ms in (3, 40, 150, 3000):
        tick(ms)
    recent = tick(100, timezone.now())  # its transaction may still be open elsewhere: not yet

    first = scrape(client)
    assert value(first, "dynarl_tick_duration_seconds_count") == 4
    assert value(first, "dynarl_tick_duration_seconds_bucket", le="0.005") == 1
    assert value(first, "dynarl_tick_duration_seconds_bucket", le="0.05") == 2
    assert value(first, "dynarl_tick_duration_seconds_bucket", le="0.2") == 3
    assert value(first, "dynarl_tick_duration_seconds_bucket", le="2.0") == 3
    assert value(first, "dynarl_tick_duration_seconds_bucket", le="5.0") == 4
    assert value(first, "dynarl_tick_duration_seconds_bucket", le="+Inf") == 4
    assert value(first, "dynarl_tick_duration_seconds_sum") == pytest.approx(3.193)

    # Scraping again counts nothing twice, and rows after an unsettled one wait for it.
    tick(7)
    assert value(scrape(client), "dynarl_tick_duration_seconds_count") == 4
    # A minute on, the recent tick has settled: it and everything after it are added.
    Tick.objects.filter(pk=recent.pk).update(started_at=old)
    tick(8000)
    later = scrape(client)
    assert value(later, "dynarl_tick_duration_seconds_count") == 7
    assert value(later, "dynarl_tick_duration_seconds_bucket", le="0.01") == 2
    assert value(later, "dynarl_tick_duration_seconds_bucket", le="0.1") == 4
    assert value(later, "dynarl_tick_duration_seconds_bucket", le="5.0") == 6
    assert value(later, "dynarl_tick_duration_seconds_bucket", le="+Inf") == 7
    assert value(later, "dynarl_tick_duration_seconds_sum") == pytest.approx(11.3)


def test_tick_histogram_starts_over_when_the_database_is_replaced(client: Client) -> None:
    job = make_job(make_user("op", "operator"))
    Tick.objects.create(
        job=job, started_at=timezone.now() - timedelta(minutes=5), duration_ms=10, outcome="x"
    )
    redis.Redis.from_url(settings.REDIS_URL).set(metrics.TICK_HWM_KEY, 10**12)  # ids from another database
    scrape(client)  # notices and resets
    assert value(scrape(client), "dynarl_tick_duration_seconds_count") == 1


def test_decisions_and_migrations_follow_their_rows(client: Client) -> None:
    job = make_job(make_user("op", "operator"))
    for reason in ("idle_rollout", "idle_rollout", "bottleneck"):
        SchedulingDecision.objects.create(job=job, policy="dynarl", reason=reason)
    SchedulingDecision.objects.create(job=job, policy="manual", reason="operator_request")

    def migration(n: int, strategy: str, state: str) -> None:
        Migration.objects.create(migration_id=f"m{n}", job=job, strategy=strategy, plan={}, state=state)

    migration(1, "workload+p2p", "committed")
    migration(2, "workload+p2p", "committed")
    migration(3, "workload+p2p", "rolled_back")
    migration(4, "restart+restart", "failed")
    migration(5, "workload+p2p", "running")

    samples = scrape(client)
    assert value(samples, "dynarl_decisions_total", policy="dynarl", reason="idle_rollout") == 2
    assert value(samples, "dynarl_decisions_total", policy="dynarl", reason="bottleneck") == 1
    assert value(samples, "dynarl_decisions_total", policy="manual", reason="operator_request") == 1
    assert value(samples, "dynarl_migrations_total", strategy="workload+p2p", outcome="committed") == 2
    assert value(samples, "dynarl_migrations_total", strategy="workload+p2p", outcome="rolled_back") == 1
    assert value(samples, "dynarl_migrations_total", strategy="restart+restart", outcome="failed") == 1
    assert value(samples, "dynarl_migrations_in_flight", strategy="workload+p2p", state="running") == 1
    assert (
        "dynarl_migrations_total",
        frozenset({("strategy", "workload+p2p"), ("outcome", "running")}),
    ) not in samples


def test_telemetry_rate_counts_recent_samples_only(client: Client, telemetry: Callable[..., None]) -> None:
    job = make_job(make_user("op", "operator"))
    group = make_group(job, "rollout", "rollout")
    busy, quiet = make_worker(group, "j-rollout-w0"), make_worker(group, "j-rollout-w1")
    # Four buckets of 10 samples well inside the last minute, and older ones outside it.
    telemetry(busy, utilisation=0.9, span_s=40, until_ago_s=10)
    telemetry(quiet, utilisation=0.5, span_s=60, until_ago_s=300)

    samples = scrape(client)
    assert value(samples, "dynarl_telemetry_samples_per_second") == pytest.approx(40 / 60)
    assert value(samples, "dynarl_telemetry_reporting_workers") == 1


def test_queue_jobs_gpus_nodes_and_alerts_follow_their_rows(client: Client) -> None:
    owner = make_user("op", "operator")
    for n in range(3):
        make_job(owner, f"waiting-{n}", state=JobState.PENDING)
    running = make_job(owner, "running", state=JobState.RUNNING)
    make_job(owner, "done", state=JobState.SUCCEEDED)
    worker = make_worker(make_group(running, "actor", "actor"), "running-actor-w0")
    h100 = make_node("node-a", gpus=4, heartbeat_ago_s=2)
    for device in h100.devices.filter(index__lt=2):
        allocate(device, worker)
    h20 = make_node("node-b", gpus=2, hardware="H20", heartbeat_ago_s=90)
    h20.status = NodeStatus.LOST
    h20.save()
    h20.devices.update(status=DeviceStatus.LOST)
    Alert.objects.create(kind=AlertKind.HEARTBEAT_GAP, subject="node:node-b", node=h20, message="silent")
    Alert.objects.create(
        kind=AlertKind.WORKER_STUCK, subject="worker:x", message="idle", cleared_at=timezone.now()
    )

    samples = scrape(client)
    assert value(samples, "dynarl_queue_length") == 3
    assert value(samples, "dynarl_jobs", state="pending") == 3
    assert value(samples, "dynarl_jobs", state="running") == 1
    assert value(samples, "dynarl_jobs", state="cancelled") == 0
    assert value(samples, "dynarl_gpus", status="allocated", hardware="H100") == 2
    assert value(samples, "dynarl_gpus", status="free", hardware="H100") == 2
    assert value(samples, "dynarl_gpus", status="lost", hardware="H20") == 2
    assert value(samples, "dynarl_nodes", status="ready") == 1
    assert value(samples, "dynarl_nodes", status="lost") == 1
    assert value(samples, "dynarl_node_heartbeat_age_seconds", node="node-b") >= 90
    assert value(samples, "dynarl_node_heartbeat_age_seconds", node="node-a") < 90
    assert value(samples, "dynarl_alerts_open", kind="heartbeat_gap") == 1
    assert value(samples, "dynarl_alerts_open", kind="worker_stuck") == 0  # cleared


def test_metrics_are_open_to_this_machine_without_a_token_setting(client: Client, settings: Settings) -> None:
    settings.METRICS_TOKEN = None
    assert "dynarl_queue_length" in {name for name, _ in scrape(client)}


def test_metrics_token_requires_the_bearer_header(client: Client, settings: Settings) -> None:
    settings.METRICS_TOKEN = "scrape-secret"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic scrape-secret"}):
        response = client.get("/metrics", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "not_authenticated"
        assert response["WWW-Authenticate"].startswith("Bearer")
    assert value(scrape(client, Authorization="Bearer scrape-secret"), "dynarl_queue_length") == 0


def test_metrics_without_a_token_are_refused_to_other_machines(client: Client, settings: Settings) -> None:
    """The default with no METRICS_TOKEN: loopback only (issue 11, finding 10: /metrics was open)."""
    settings.METRICS_TOKEN = None
    for address in ("198.51.100.9", "10.0.0.5", "::ffff:198.51.100.9"):
        response = client.get("/metrics", REMOTE_ADDR=address)
        assert response.status_code == 403, address
        error = response.json()["error"]
        assert error["code"] == "permission_denied"
        assert address in error["message"] and "METRICS_ALLOWED_IPS" in error["message"]
    for address in ("127.0.0.1", "127.0.0.53", "::1"):
        assert client.get("/metrics", REMOTE_ADDR=address).status_code == 200, address
    assert settings.METRICS_ALLOWED_IPS == ["127.0.0.0/8", "::1"]


def test_metrics_allow_list_and_token_both_apply(client: Client, settings: Settings) -> None:
    settings.METRICS_TOKEN = "scrape-secret"
    settings.METRICS_ALLOWED_IPS = ["10.0.0.0/8"]
    good = {"Authorization": "Bearer scrape-secret"}
    assert client.get("/metrics", headers=good, REMOTE_ADDR="10.1.2.3").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 401  # no token
    assert client.get("/metrics", headers=good, REMOTE_ADDR="127.0.0.1").status_code == 403
    # A token with no allow-list: any address that presents it.
    settings.METRICS_ALLOWED_IPS = []
    assert client.get("/metrics", headers=good, REMOTE_ADDR="198.51.100.9").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="198.51.100.9").status_code == 401
