"""The live-event WebSockets, over the real Redis channel layer and the real ASGI stack."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from cluster.models import DeviceStatus
from common import events
from common.models import ApiToken
from controlplane.asgi import application
from controlplane.consumers import CLOSE_NO_SUCH_JOB, CLOSE_NOT_AUTHENTICATED
from jobs.models import JobState
from scheduler.models import Alert, AlertKind, HypergraphSnapshot, Migration, SchedulingDecision
from tests.live.conftest import allocate, make_group, make_job, make_node, make_user, make_worker

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = (b"origin", b"http://127.0.0.1:8000")
WAIT_S = 10  # generous: Redis is real and CI machines are slow


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async_to_sync(scenario)()


def session_cookie(user: User) -> tuple[bytes, bytes]:
    client = Client()
    client.force_login(user)
    return (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())


def communicator(path: str, headers: list[tuple[bytes, bytes]] | None = None) -> WebsocketCommunicator:
    return WebsocketCommunicator(application, path, headers=headers or [ORIGIN])


async def connect_ok(comm: WebsocketCommunicator) -> dict[str, Any]:
    connected, _ = await comm.connect(timeout=WAIT_S)
    assert connected
    hello: dict[str, Any] = await comm.receive_json_from(timeout=WAIT_S)
    assert hello["type"] == "hello", hello
    return hello


async def closed_with(comm: WebsocketCommunicator) -> int:
    connected, _ = await comm.connect(timeout=WAIT_S)
    assert connected  # accepted first, so the code reaches the client
    frame = await comm.receive_output(timeout=WAIT_S)
    assert frame["type"] == "websocket.close", frame
    await comm.disconnect()
    return int(frame["code"])


async def publish(event_type: str, data: dict[str, Any], **where: Any) -> None:
    await database_sync_to_async(events.publish)(event_type, data, **where)


def test_anonymous_connection_is_closed_with_4401() -> None:
    owner = make_user("owner", "operator")
    job = make_job(owner)

    async def scenario() -> None:
        assert await closed_with(communicator(f"/ws/jobs/{job.pk}/")) == CLOSE_NOT_AUTHENTICATED
        assert await closed_with(communicator("/ws/cluster/")) == CLOSE_NOT_AUTHENTICATED

    run(scenario)


def test_unknown_revoked_or_expired_token_is_closed_with_4401() -> None:
    user = make_user("viewer")
    job = make_job(user)
    revoked, revoked_raw = ApiToken.issue(user, "revoked")
    revoked.revoked_at = timezone.now()
    revoked.save()
    _, expired_raw = ApiToken.issue(user, "expired", expires_at=timezone.now() - timedelta(minutes=1))

    async def scenario() -> None:
        for raw in ("dynarl_not-a-token", revoked_raw, expired_raw):
            code = await closed_with(WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/?token={raw}"))
            assert code == CLOSE_NOT_AUTHENTICATED

    run(scenario)


def test_a_bad_token_does_not_fall_back_to_the_session() -> None:
    user = make_user("viewer")
    job = make_job(user)
    cookie = session_cookie(user)

    async def scenario() -> None:
        comm = communicator(f"/ws/jobs/{job.pk}/?token=wrong", [ORIGIN, cookie])
        assert await closed_with(comm) == CLOSE_NOT_AUTHENTICATED

    run(scenario)


def test_session_from_a_foreign_origin_is_refused_at_the_handshake() -> None:
    user = make_user("viewer")
    job = make_job(user)
    cookie = session_cookie(user)

    async def scenario() -> None:
        comm = communicator(f"/ws/jobs/{job.pk}/", [(b"origin", b"https://evil.example"), cookie])
        connected, _ = await comm.connect(timeout=WAIT_S)
        assert not connected
        # No Origin at all is refused too unless the client authenticates with a token.
        comm = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=[cookie])
        connected, _ = await comm.connect(timeout=WAIT_S)
        assert not connected

    run(scenario)


def test_viewer_session_gets_a_hello_with_the_current_state() -> None:
    owner = make_user("owner", "operator")
    viewer = make_user("viewer", "viewer")
    job = make_job(owner, "math", state=JobState.RUNNING, iteration=3, tokens_per_s=1234.5)
    HypergraphSnapshot.objects.create(
        job=job,
        schema_version=1,
        digest="a",
        cause="admission",
        data={},
        taken_at=timezone.now() - timedelta(minutes=1),
    )
    latest = HypergraphSnapshot.objects.create(job=job, schema_version=1, digest="b", cause="change", data={})
    SchedulingDecision.objects.create(
        job=job, policy="dynarl", reason="idle_rollout", at=timezone.now() - timedelta(seconds=5)
    )
    last = SchedulingDecision.objects.create(job=job, policy="dynarl", reason="bottleneck")
    migration = Migration.objects.create(
        migration_id="m-1", job=job, decision=last, strategy="workload+p2p", plan={}, state="running"
    )
    Alert.objects.create(kind=AlertKind.THROUGHPUT_COLLAPSE, subject=f"job:{job.pk}", job=job, message="slow")
    cookie = session_cookie(viewer)

    async def scenario() -> None:
        comm = communicator(f"/ws/jobs/{job.pk}/", [ORIGIN, cookie])
        hello = await connect_ok(comm)
        data = hello["data"]
        assert data["scope"] == "job"
        assert data["job"]["id"] == job.pk
        assert data["job"]["state"] == "running"
        assert data["job"]["iteration"] == 3
        assert data["job"]["tokens_per_s"] == 1234.5
        assert data["latest_snapshot_id"] == latest.pk
        assert data["last_decision_id"] == last.pk
        assert data["open_migration"]["migration_id"] == migration.migration_id
        assert [a["kind"] for a in data["open_alerts"]] == ["throughput_collapse"]
        await comm.disconnect()

    run(scenario)


def test_unknown_job_is_closed_with_4404() -> None:
    cookie = session_cookie(make_user("viewer"))

    async def scenario() -> None:
        comm = communicator("/ws/jobs/999999/", [ORIGIN, cookie])
        assert await closed_with(comm) == CLOSE_NO_SUCH_JOB

    run(scenario)


def test_token_client_without_origin_receives_published_events() -> None:
    viewer = make_user("viewer")
    job = make_job(viewer)
    token, raw = ApiToken.issue(viewer, "cli")

    async def scenario() -> None:
        comm = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/?token={raw}")
        await connect_ok(comm)
        await publish("decision", {"id": 7, "reason": "idle_rollout"}, job_id=job.pk)
        frame = await comm.receive_json_from(timeout=WAIT_S)
        assert frame["type"] == "decision"
        assert frame["data"] == {"id": 7, "reason": "idle_rollout"}
        assert "at" in frame
        await publish("migration.step", {"step_id": "m-1/0", "state": "done"}, job_id=job.pk)
        frame = await comm.receive_json_from(timeout=WAIT_S)
        assert (frame["type"], frame["data"]["state"]) == ("migration.step", "done")
        await comm.disconnect()

    run(scenario)
    token.refresh_from_db()
    assert token.last_used_at is not None


def test_a_watcher_of_job_a_does_not_get_job_b_events() -> None:
    viewer = make_user("viewer")
    job_a, job_b = make_job(viewer, "a"), make_job(viewer, "b")
    _, raw = ApiToken.issue(viewer, "cli")

    async def scenario() -> None:
        watch_a = WebsocketCommunicator(application, f"/ws/jobs/{job_a.pk}/?token={raw}")
        watch_b = WebsocketCommunicator(application, f"/ws/jobs/{job_b.pk}/?token={raw}")
        await connect_ok(watch_a)
        await connect_ok(watch_b)
        await publish("snapshot", {"id": 1, "job": "b"}, job_id=job_b.pk)
        await publish("snapshot", {"id": 2, "job": "a"}, job_id=job_a.pk)
        # Both went through Redis in this order: had b's leaked to a, it would come first.
        assert (await watch_a.receive_json_from(timeout=WAIT_S))["data"] == {"id": 2, "job": "a"}
        assert (await watch_b.receive_json_from(timeout=WAIT_S))["data"] == {"id": 1, "job": "b"}
        await watch_a.disconnect()
        await watch_b.disconnect()

    run(scenario)


def test_cluster_hello_counts_rows_and_only_cluster_events_arrive() -> None:
    operator = make_user("op", "operator")
    make_job(operator, "waiting", state=JobState.PENDING)
    make_job(operator, "waiting-too", state=JobState.PENDING)
    running = make_job(operator, "running", state=JobState.RUNNING)
    worker = make_worker(make_group(running, "actor", "actor"), "running-actor-w0")
    node = make_node("node-a", gpus=3)
    allocate(node.devices.get(index=0), worker)
    lost = make_node("node-b", gpus=1)
    lost.devices.update(status=DeviceStatus.LOST)
    Alert.objects.create(kind=AlertKind.HEARTBEAT_GAP, subject="node:node-b", node=lost, message="silent")
    _, raw = ApiToken.issue(operator, "cli")

    async def scenario() -> None:
        comm = WebsocketCommunicator(application, f"/ws/cluster/?token={raw}")
        data = (await connect_ok(comm))["data"]
        assert data["scope"] == "cluster"
        assert data["queue_length"] == 2
        assert data["jobs"]["running"] == 1
        assert data["jobs"]["succeeded"] == 0
        assert data["gpus"] == {"free": 2, "allocated": 1, "lost": 1}
        assert data["nodes"]["ready"] == 2
        assert data["open_alerts"]["heartbeat_gap"] == 1
        await publish("decision", {"id": 1}, job_id=running.pk)  # a job's page only
        await publish("alert", {"id": 9, "state": "raised"}, job_id=running.pk, cluster=True)
        frame = await comm.receive_json_from(timeout=WAIT_S)
        assert frame["type"] == "alert"
        assert frame["data"]["id"] == 9
        await comm.disconnect()

    run(scenario)


def test_resync_sends_a_fresh_hello_and_ping_answers_pong() -> None:
    viewer = make_user("viewer")
    job = make_job(viewer, state=JobState.RUNNING)
    _, raw = ApiToken.issue(viewer, "cli")

    async def scenario() -> None:
        comm = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/?token={raw}")
        assert (await connect_ok(comm))["data"]["latest_snapshot_id"] is None
        snapshot = await database_sync_to_async(HypergraphSnapshot.objects.create)(
            job=job, schema_version=1, digest="x", cause="change", data={}
        )
        await comm.send_json_to({"type": "resync"})
        hello = await comm.receive_json_from(timeout=WAIT_S)
        assert hello["type"] == "hello"
        assert hello["data"]["latest_snapshot_id"] == snapshot.pk
        await comm.send_json_to({"type": "ping"})
        assert (await comm.receive_json_from(timeout=WAIT_S))["type"] == "pong"
        await comm.send_json_to({"type": "subscribe-everything"})
        assert (await comm.receive_json_from(timeout=WAIT_S))["type"] == "error"
        await comm.send_to(text_data="{not json")
        assert (await comm.receive_json_from(timeout=WAIT_S))["type"] == "error"
        await comm.send_to(bytes_data=b"\x00\x01")
        assert (await comm.receive_json_from(timeout=WAIT_S))["type"] == "error"
        await comm.send_json_to({"type": "ping"})  # still open and answering
        assert (await comm.receive_json_from(timeout=WAIT_S))["type"] == "pong"
        await comm.disconnect()

    run(scenario)


def test_http_still_served_by_django_through_the_asgi_app(monkeypatch: pytest.MonkeyPatch) -> None:
    from channels.testing import HttpCommunicator
    from django.db import connections

    # Django answers each ASGI request in a thread of its own; without persistent connections
    # that thread's connection is closed when the request ends instead of outliving the test.
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)

    async def scenario() -> None:
        comm = HttpCommunicator(application, "GET", "/healthz", headers=[(b"host", b"127.0.0.1")])
        response = await comm.get_response(timeout=WAIT_S)
        # Hang up and let Django finish the request, which closes its database connection.
        await comm.send_input({"type": "http.disconnect"})
        await comm.wait(timeout=WAIT_S)
        # No Celery worker runs here, so 503; what matters is that Django's view answered.
        assert response["status"] in (200, 503)
        assert json.loads(response["body"])["checks"]["database"]["ok"] is True

    run(scenario)
