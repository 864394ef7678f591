"""Registration: bootstrap token in, node token out; re-registering keeps ownership."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from agents.models import BootstrapToken, NodeToken
from cluster.models import AgentCommand, CommandState, Device, DeviceStatus, Node, NodeStatus
from common.models import AuditEvent, hash_token
from jobs.models import Worker
from tests.agents.conftest import devices, register
from tests.factories import make_user, spec, submit
from tests.services import REPO_ROOT

pytestmark = pytest.mark.django_db


def post_register(client: Client, token: str, body: dict[str, object]) -> object:
    return client.post(
        "/api/v1/agent/register",
        data=body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


@pytest.mark.parametrize("kind", ["unknown", "revoked", "expired", "missing"])
def test_bad_bootstrap_token_is_refused(client: Client, bootstrap: str, kind: str) -> None:
    body = {"host": "node-a", "devices": devices(2)}
    token = bootstrap
    if kind == "unknown":
        token = "not-a-token"
    elif kind == "revoked":
        BootstrapToken.objects.update(revoked_at=timezone.now())
    elif kind == "expired":
        BootstrapToken.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    headers = {} if kind == "missing" else {"Authorization": f"Bearer {token}"}
    response = client.post(
        "/api/v1/agent/register", data=body, content_type="application/json", headers=headers
    )
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["status"] == 401 and error["code"] == "not_authenticated" and error["request_id"]
    assert response["X-Request-ID"] == error["request_id"]
    assert not Node.objects.exists()


def test_register_creates_node_devices_and_a_token(client: Client, bootstrap: str) -> None:
    agent, body = register(client, bootstrap, "node-a", gpus=4, hardware="A100")
    node = Node.objects.get(name="node-a")
    assert body["created"] is True and body["protocol"] == 1
    assert body["node"]["status"] == node.status == NodeStatus.READY
    assert [(d.index, d.uid, d.hardware, d.memory_gb, d.status) for d in node.devices.order_by("index")] == [
        (i, f"node-a/gpu{i}", "A100", 80.0, DeviceStatus.FREE) for i in range(4)
    ]
    assert [d["uid"] for d in body["devices"]] == [f"node-a/gpu{i}" for i in range(4)]
    # Only the hash is kept; the raw key works as the node's credential.
    assert NodeToken.objects.get(node=node).key_hash == hash_token(agent.token)
    assert not NodeToken.objects.filter(key_hash=agent.token).exists()
    assert agent.heartbeat({"sent_at": 1.0}).status_code == 200
    event = AuditEvent.objects.get(verb="node.register")
    assert event.actor == "agent:node-a" and event.object_id == str(node.pk)
    # The request id travels with the work into the audit trail.
    again = client.post(
        "/api/v1/agent/register",
        data={"host": "node-a", "devices": devices(4, "A100")},
        content_type="application/json",
        headers={"Authorization": f"Bearer {bootstrap}", "X-Request-ID": "req-reregister-1"},
    )
    assert again.status_code == 200 and again["X-Request-ID"] == "req-reregister-1"
    assert AuditEvent.objects.get(verb="node.reregister").request_id == "req-reregister-1"
    assert body["settings"]["heartbeat_interval_s"] > 0 and body["settings"]["lost_after_s"] > 0


def test_reregister_rotates_token_and_keeps_ownership(client: Client, bootstrap: str) -> None:
    first, _ = register(client, bootstrap, "node-a", gpus=4)
    job = submit(make_user("alice"), spec(rollout=2, actor=2))
    owners_before = dict(Device.objects.values_list("uid", "worker__name"))
    assert all(owners_before.values())
    launch = AgentCommand.objects.get(kind="launch_workers")
    assert first.fetch().json()["commands"][0]["command_id"] == launch.command_id

    second, body = register(client, bootstrap, "node-a", gpus=4)

    assert body["created"] is False and second.token != first.token
    assert first.heartbeat({"sent_at": 1.0}).status_code == 401
    assert second.heartbeat({"sent_at": 1.0}).status_code == 200
    assert Node.objects.count() == 1 and Device.objects.count() == 4
    assert dict(Device.objects.values_list("uid", "worker__name")) == owners_before
    assert set(Device.objects.values_list("status", flat=True)) == {DeviceStatus.ALLOCATED}
    # The new agent is told what to run, with the job's spec to run it from ...
    assert sorted(w["worker"] for w in body["workers"]) == sorted(
        Worker.objects.filter(group__job=job).values_list("name", flat=True)
    )
    assert all(len(w["devices"]) == 1 and w["job"] == job.pk for w in body["workers"])
    assert not any(d["shared"] for w in body["workers"] for d in w["devices"])
    assert body["jobs"][str(job.pk)]["name"] == job.spec["name"]
    assert {d["worker"] for d in body["devices"]} == set(owners_before.values())
    # ... and what the old one was given but never answered comes again at once.
    launch.refresh_from_db()
    assert launch.state == CommandState.QUEUED
    again = second.fetch().json()["commands"]
    assert [c["command_id"] for c in again] == [launch.command_id] and again[0]["deliveries"] == 2
    assert AuditEvent.objects.filter(verb="node.reregister", payload__token_rotated=True).exists()


def test_colocated_workers_are_told_their_devices_are_time_shared(client: Client, bootstrap: str) -> None:
    register(client, bootstrap, "node-a", gpus=8)
    colocated = json.loads((REPO_ROOT / "examples" / "math-1.5b-colocated.json").read_text())
    job = submit(make_user("alice"), colocated)
    # Rollout, reward and actor all on GPUs 0-7: every worker is launched with its devices marked
    # shared, whichever of them owns a device in the database ...
    launch = AgentCommand.objects.get(kind="launch_workers")
    workers = launch.payload["workers"]
    assert {w["group"] for w in workers} == {"rollout", "reward", "actor"}
    assert all(d["shared"] is True for w in workers for d in w["devices"])
    # ... and a restarted agent is told the same.
    _, body = register(client, bootstrap, "node-a", gpus=8)
    assert sorted(w["worker"] for w in body["workers"]) == sorted(
        Worker.objects.filter(group__job=job).values_list("name", flat=True)
    )
    assert all(d["shared"] is True for w in body["workers"] for d in w["devices"])


def test_reregister_updates_devices(client: Client, bootstrap: str) -> None:
    register(client, bootstrap, "node-a", gpus=4)
    _, body = register(client, bootstrap, "node-a", gpus=2, hardware="H200")
    by_index = {d.index: d for d in Device.objects.all()}
    assert [by_index[i].hardware for i in (0, 1)] == ["H200", "H200"]
    assert [by_index[i].status for i in (2, 3)] == [DeviceStatus.LOST, DeviceStatus.LOST]
    assert AuditEvent.objects.get(verb="node.devices_missing").payload["devices"] == [
        "node-a/gpu2",
        "node-a/gpu3",
    ]
    _, body = register(client, bootstrap, "node-a", gpus=4, hardware="H200")
    assert {d["status"] for d in body["devices"]} == {DeviceStatus.FREE}


def test_invalid_registration_names_fields_and_writes_nothing(client: Client, bootstrap: str) -> None:
    body = {
        "host": "bad host!",
        "backend": "k8s",
        "steps_outlive_agent": "yes",
        "devices": [
            {"index": 0, "hardware": "H100", "memory_gb": 80},
            {"index": 0, "hardware": "", "memory_gb": -1},
        ],
    }
    response = post_register(client, bootstrap, body)
    assert response.status_code == 400  # type: ignore[attr-defined]
    paths = {f["path"] for f in response.json()["error"]["fields"]}  # type: ignore[attr-defined]
    assert paths == {
        "host",
        "backend",
        "steps_outlive_agent",
        "devices[1].index",
        "devices[1].hardware",
        "devices[1].memory_gb",
    }
    assert not Node.objects.exists() and not Device.objects.exists()
    bad_json = client.post(
        "/api/v1/agent/register",
        data="{not json",
        content_type="application/json",
        headers={"Authorization": f"Bearer {bootstrap}"},
    )
    assert bad_json.status_code == 400 and bad_json.json()["error"]["fields"][0]["path"] == ""


def test_an_agent_whose_steps_outlive_it_says_so_at_each_registration(client: Client, bootstrap: str) -> None:
    register(client, bootstrap, "node-a", gpus=2)
    assert Node.objects.get(name="node-a").steps_outlive_agent is False  # an older agent says nothing
    register(client, bootstrap, "node-a", gpus=2, steps_outlive_agent=True)
    assert Node.objects.get(name="node-a").steps_outlive_agent is True
    assert (
        AuditEvent.objects.filter(verb="node.reregister").latest("pk").payload["steps_outlive_agent"] is True
    )


def test_register_brings_a_lost_node_back(client: Client, bootstrap: str) -> None:
    register(client, bootstrap, "node-a", gpus=2)
    Node.objects.update(status=NodeStatus.LOST)
    Device.objects.update(status=DeviceStatus.LOST)
    _, body = register(client, bootstrap, "node-a", gpus=2)
    assert body["node"]["status"] == NodeStatus.READY
    assert set(Device.objects.values_list("status", flat=True)) == {DeviceStatus.FREE}


def test_register_only_accepts_post(client: Client, bootstrap: str) -> None:
    response = client.get("/api/v1/agent/register", headers={"Authorization": f"Bearer {bootstrap}"})
    assert response.status_code == 405 and response["Allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"
