"""A database with no connection to give: 503 with Retry-After (never a 500), ticks retried.

Issue 11, finding 5: 200 job submissions from 50 threads ran PostgreSQL out of connections and
answered 500 "too many clients already". The machine's server is shared, so its max_connections
cannot be lowered for a test; a dedicated role with a small ``CONNECTION LIMIT`` gives the server
processes the same small budget (PostgreSQL refuses that role's extra connections with "too many
connections for role", SQLSTATE 53300, as it refuses anyone's past max_connections). The role is
dropped after each test.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import Client
from psycopg import sql

from common.audit import Actor
from common.models import ApiToken, AuditEvent
from controlplane.celery import app
from jobs import services
from jobs.models import Job, JobReason, JobState, JobTransition, WorkerGroup
from scheduler.models import Tick
from scheduler.tasks import run_tick
from tests.factories import make_cluster, make_user, mark_running, spec
from tests.services import celery_process, wait_until
from tests.stack import FAST_SETTINGS, LiveServer, flush_test_redis

pytestmark = pytest.mark.django_db(transaction=True)

SUBMISSIONS = 200
THREADS = 50
CONNECTION_LIMIT = 10  # the role's; the server process pools at most 8 of them


@dataclass
class StormRole:
    """A login role of the test database whose connections PostgreSQL caps at ``limit``."""

    name: str
    password: str
    limit: int

    def url(self) -> str:
        params = connection.settings_dict
        host, port = params["HOST"] or "127.0.0.1", params["PORT"] or 5432
        return f"postgres://{self.name}:{self.password}@{host}:{port}/{params['NAME']}"

    def set_limit(self, limit: int) -> None:
        with _superuser() as conn:
            conn.execute(
                sql.SQL("ALTER ROLE {} CONNECTION LIMIT {}").format(
                    sql.Identifier(self.name), sql.Literal(limit)
                )
            )
        self.limit = limit


def _superuser() -> psycopg.Connection[Any]:
    """A connection to the test database as the tests' own (superuser) role."""
    params = connection.settings_dict
    return psycopg.connect(
        host=params["HOST"] or "127.0.0.1",
        port=int(params["PORT"] or 5432),
        user=params["USER"],
        password=params["PASSWORD"] or None,
        dbname=params["NAME"],
        autocommit=True,
    )


def _drop_role(conn: psycopg.Connection[Any], name: str) -> None:
    exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [name]).fetchone()
    if exists is None:
        return
    conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [name])
    role = sql.Identifier(name)
    conn.execute(sql.SQL("DROP OWNED BY {}").format(role))  # its grants here and on the database
    conn.execute(sql.SQL("DROP ROLE {}").format(role))


@pytest.fixture
def storm_role(request: pytest.FixtureRequest) -> Iterator[StormRole]:
    """The role, granted what the control plane needs in the test database; ``limit`` from the
    test's ``connection_limit`` parameter, else CONNECTION_LIMIT."""
    limit = int(getattr(request, "param", CONNECTION_LIMIT))
    # Roles are cluster-wide: named after the test database, so parallel runs do not collide.
    role = StormRole(f"storm_{connection.settings_dict['NAME']}"[:63], secrets.token_urlsafe(16), limit)
    ident = sql.Identifier(role.name)
    with _superuser() as conn:
        _drop_role(conn, role.name)  # one an interrupted run left behind
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} CONNECTION LIMIT {}").format(
                ident, sql.Literal(role.password), sql.Literal(limit)
            )
        )
        database = sql.Identifier(connection.settings_dict["NAME"])
        conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(database, ident))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(ident))
        conn.execute(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}").format(ident)
        )
        conn.execute(
            sql.SQL("GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {}").format(ident)
        )
    try:
        yield role
    finally:
        with _superuser() as conn:
            _drop_role(conn, role.name)


def server_env(service_env: dict[str, str], role: StormRole, **extra: str) -> dict[str, str]:
    return {
        **service_env,
        **FAST_SETTINGS,
        "DATABASE_URL": role.url(),
        "DB_BUSY_RETRY_AFTER_S": "1",
        **extra,
    }


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], LiveServer]]:
    servers: list[LiveServer] = []

    def start(env: dict[str, str]) -> LiveServer:
        logs = tmp_path / f"server-{len(servers)}"
        logs.mkdir()
        server = LiveServer(env, logs)
        servers.append(server)
        server.start()
        return server

    flush_test_redis()
    yield start
    for server in servers:
        if server.running():
            server.stop()
    flush_test_redis()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: Any


def call(url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None) -> Answer:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, raw, got = response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        status, raw, got = exc.code, exc.read(), dict(exc.headers)
    content_type = got.get("Content-Type", "")
    decoded = json.loads(raw) if raw and "json" in content_type else raw.decode(errors="replace")
    return Answer(status, got, decoded)


def is_busy_answer(answer: Answer) -> bool:
    """A 503 the way the API promises it: Retry-After, and the error shape naming the cause."""
    return (
        answer.status == 503
        and answer.headers.get("Retry-After", "").isdigit()
        and isinstance(answer.body, dict)
        and answer.body["error"]["code"] == "database_busy"
    )


def test_a_storm_of_submissions_gets_no_server_error_and_writes_every_job_whole(
    storm_role: StormRole, service_env: dict[str, str], start_server: Callable[..., LiveServer]
) -> None:
    make_cluster({f"storm-node-{i}": ("H100", 8) for i in range(4)})
    operator = make_user("storm-operator", "operator")
    token = ApiToken.issue(operator, "storm")[1]
    server = start_server(server_env(service_env, storm_role, DB_POOL_MAX_SIZE="8", DB_POOL_TIMEOUT_S="20"))
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def submit(i: int) -> Answer:
        return call(
            f"{server.url}/api/v1/jobs/",
            "POST",
            spec(f"storm-{i}", rollout=1, actor=1),
            {**headers, "Idempotency-Key": f"storm-{i}"},
        )

    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        answers = dict(zip(range(SUBMISSIONS), pool.map(submit, range(SUBMISSIONS)), strict=True))

    failures = {
        i: (a.status, a.headers.get("Retry-After"), a.body)
        for i, a in answers.items()
        if a.status not in (200, 201) and not is_busy_answer(a)
    }
    assert not failures, (
        f"{len(failures)} answers neither accepted nor 503-with-Retry-After: "
        + str(dict(list(failures.items())[:5]))
        + f"\n{server.log_text()[-5000:]}"
    )

    # A client that honours Retry-After gets every submission in, once (same idempotency key).
    for i, answer in answers.items():
        for _ in range(30):
            if answer.status in (200, 201):
                break
            time.sleep(int(answer.headers["Retry-After"]))  # the protocol: come back after that
            answer = submit(i)
            assert answer.status in (200, 201) or is_busy_answer(answer), (answer.status, answer.body)
        assert answer.status in (200, 201), (i, answer.status, answer.body)
        answers[i] = answer

    # Nothing half-written: one job per submission, each with all of its rows.
    ids = {answers[i].body["id"] for i in range(SUBMISSIONS)}
    assert len(ids) == SUBMISSIONS
    assert set(Job.objects.values_list("pk", flat=True)) == ids
    for job in Job.objects.all():
        assert job.name.startswith("storm-") and job.idempotency_key == job.name
        assert WorkerGroup.objects.filter(job=job).count() == 2, job.name
        assert JobTransition.objects.filter(
            job=job, to_state=JobState.PENDING, reason=JobReason.SUBMITTED
        ).exists(), job.name
        assert AuditEvent.objects.filter(job=job, verb="job.submit").count() == 1, job.name


@pytest.mark.parametrize("storm_role", [0], indirect=True)  # PostgreSQL refuses every connection
@pytest.mark.parametrize("pool_size", ["4", "0"], ids=["pooled", "unpooled"])
def test_requests_that_get_no_connection_are_answered_503_with_retry_after(
    storm_role: StormRole,
    service_env: dict[str, str],
    start_server: Callable[..., LiveServer],
    pool_size: str,
) -> None:
    """Pooled, the wait for a connection times out (PoolTimeout); unpooled, the server's refusal
    itself comes back. Either way: API, agent protocol, pages and /metrics answer 503."""
    operator = make_user("busy-operator", "operator")
    token = ApiToken.issue(operator, "busy")[1]
    browser = Client()
    browser.force_login(operator)  # a session row the server will not be able to read
    session = browser.cookies["sessionid"].value
    server = start_server(
        server_env(service_env, storm_role, DB_POOL_MAX_SIZE=pool_size, DB_POOL_TIMEOUT_S="1")
    )
    bearer = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    api_get = call(f"{server.url}/api/v1/jobs/", headers=bearer)
    api_post = call(f"{server.url}/api/v1/jobs/", "POST", spec("busy"), {**bearer, "Idempotency-Key": "busy"})
    agent = call(
        f"{server.url}/api/v1/agent/heartbeat",
        "POST",
        {"devices": []},
        {"Authorization": "Bearer some-node-token", "Content-Type": "application/json"},
    )
    for answer in (api_get, api_post, agent):
        assert is_busy_answer(answer), (answer.status, answer.body)
        assert answer.headers["Retry-After"] == "1"
        assert "retry in 1 s" in answer.body["error"]["message"]

    page = call(f"{server.url}/", headers={"Cookie": f"sessionid={session}", "Accept": "text/html"})
    assert page.status == 503 and page.headers["Retry-After"] == "1", (page.status, page.body)
    assert "Busy, please retry" in page.body
    metrics = call(f"{server.url}/metrics")
    assert metrics.status == 503 and metrics.headers["Retry-After"] == "1", (metrics.status, metrics.body)
    assert not Job.objects.exists()


@pytest.mark.parametrize("storm_role", [0], indirect=True)
def test_a_tick_that_gets_no_connection_runs_again_later(
    storm_role: StormRole, service_env: dict[str, str], tmp_path: Path
) -> None:
    make_cluster({"node-a": ("H100", 4)})
    owner = make_user("tick-owner")
    job = mark_running(
        services.submit_job(owner=owner, source=spec(rollout=2, actor=2), actor=Actor.for_user(owner)).job
    )
    env = server_env(
        service_env, storm_role, DB_POOL_MAX_SIZE="2", DB_POOL_TIMEOUT_S="2", DB_BUSY_RETRY_AFTER_S="3"
    )
    flush_test_redis()
    with celery_process("worker", env, tmp_path):
        assert wait_until(lambda: bool(app.control.ping(timeout=0.5)), timeout_s=60), "no worker"
        log = tmp_path / "worker.log"
        run_tick.delay(job.pk)
        assert wait_until(lambda: "database busy, retrying" in log.read_text(), timeout_s=60), log.read_text()
        assert not Tick.objects.filter(job=job).exists()
        storm_role.set_limit(CONNECTION_LIMIT)  # the database has room again
        assert wait_until(lambda: Tick.objects.filter(job=job).exists(), timeout_s=60), log.read_text()
    assert "Traceback" not in log.read_text()
    flush_test_redis()
