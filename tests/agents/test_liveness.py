"""Liveness: silent nodes are marked lost, their groups flagged, their migrations rolled back;
a heartbeat brings them back."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from pytest_django.fixtures import Settings

from agents.services import liveness
from cluster.models import Device, DeviceStatus, Node, NodeStatus
from common.audit import Actor
from common.models import AuditEvent
from controlplane.api.serializers import ClusterSummarySerializer
from controlplane.selectors import cluster_summary
from jobs import services as job_services
from jobs.admission import admit_pending
from jobs.models import Job, WorkerGroup
from scheduler.models import Migration, MigrationState
from scheduler.services import gpu_migrations
from tests.agents.conftest import Agent, register
from tests.factories import make_user, spec, submit
from tests.services import wait_until

pytestmark = pytest.mark.django_db


def run_everywhere(agents: dict[str, Agent]) -> None:
    for _ in range(20):
        fetched = {host: agent.fetch().json()["commands"] for host, agent in agents.items()}
        if not any(fetched.values()):
            return
        for host, commands in fetched.items():
            for command in commands:
                agents[host].report(command["command_id"], {"ok": True})


@pytest.fixture
def cluster(client: Client, bootstrap: str, settings: Settings) -> tuple[dict[str, Agent], Job]:
    settings.NODE_LOST_AFTER_S = 30.0
    agents = {host: register(client, bootstrap, host, gpus=4)[0] for host in ("node-a", "node-b", "node-c")}
    job = submit(make_user("alice"), spec(rollout=6, actor=2))  # 8 of the 12 GPUs
    run_everywhere(agents)
    job.refresh_from_db()
    assert job.state == "running"
    return agents, job


def silence(name: str, seconds: float) -> None:
    Node.objects.filter(name=name).update(last_heartbeat_at=timezone.now() - timedelta(seconds=seconds))


def groups_on(node: str, job: Job) -> set[str]:
    return set(
        WorkerGroup.objects.filter(job=job, workers__devices__node__name=node).values_list("name", flat=True)
    )


def test_silent_node_is_marked_lost_and_its_groups_flagged(cluster: tuple[dict[str, Agent], Job]) -> None:
    _, job = cluster
    busy = {name for name in ("node-a", "node-b", "node-c") if groups_on(name, job)}
    lost_name = sorted(busy)[0]
    owners = dict(Device.objects.filter(node__name=lost_name).values_list("uid", "worker__name"))
    assert any(owners.values())
    silence(lost_name, 31)
    silence("node-c" if lost_name != "node-c" else "node-b", 29)  # late, but not yet lost

    assert liveness.detect_lost_nodes() == [lost_name]

    lost = Node.objects.get(name=lost_name)
    assert lost.status == NodeStatus.LOST and "no heartbeat for" in lost.status_reason
    assert set(Node.objects.exclude(pk=lost.pk).values_list("status", flat=True)) == {NodeStatus.READY}
    # Every device of the node says it is lost; owned ones keep their owner for when it comes back.
    devices = Device.objects.filter(node=lost)
    assert set(devices.values_list("status", flat=True)) == {DeviceStatus.LOST}
    assert dict(devices.values_list("uid", "worker__name")) == owners
    assert event_devices_lost() == len(owners)
    flagged = set(WorkerGroup.objects.filter(job=job, flagged=True).values_list("name", flat=True))
    assert flagged == groups_on(lost_name, job) and flagged
    assert all(lost_name in g.flag_reason for g in WorkerGroup.objects.filter(flagged=True))
    event = AuditEvent.objects.get(verb="node.lost")
    assert event.actor == "liveness" and event.payload["previous_status"] == NodeStatus.READY
    assert liveness.detect_lost_nodes() == []  # already lost: nothing more to do


def event_devices_lost() -> int:
    return int(AuditEvent.objects.get(verb="node.lost").payload["devices_lost"])


def test_free_devices_of_a_lost_node_are_lost(client: Client, bootstrap: str, settings: Settings) -> None:
    settings.NODE_LOST_AFTER_S = 30.0
    register(client, bootstrap, "node-idle", gpus=2)
    silence("node-idle", 60)
    assert liveness.detect_lost_nodes() == ["node-idle"]
    assert set(Device.objects.values_list("status", flat=True)) == {DeviceStatus.LOST}


def test_lost_node_rolls_back_its_migration(cluster: tuple[dict[str, Agent], Job]) -> None:
    agents, job = cluster
    migration = gpu_migrations.request_manual_migration(
        job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(job.owner)
    )
    step_nodes = set(migration.steps.get(state="running").nodes)
    victim = sorted(step_nodes)[0]
    silence(victim, 120)
    assert liveness.detect_lost_nodes() == [victim]
    run_everywhere({h: a for h, a in agents.items() if h != victim})
    migration.refresh_from_db()
    assert migration.state in (MigrationState.ROLLED_BACK, MigrationState.FAILED)
    assert f"node {victim} lost" in migration.error
    assert AuditEvent.objects.filter(verb="migration.node_lost", actor="liveness").exists()


def test_heartbeat_brings_a_lost_node_back(cluster: tuple[dict[str, Agent], Job]) -> None:
    agents, job = cluster
    victim = sorted(n for n in agents if groups_on(n, job))[0]
    owners = dict(Device.objects.filter(node__name=victim).values_list("uid", "worker__name"))
    silence(victim, 120)
    liveness.detect_lost_nodes()
    assert WorkerGroup.objects.filter(flagged=True).exists()

    reply = agents[victim].heartbeat({"sent_at": time.time()}).json()

    assert reply["node_status"] == NodeStatus.READY and reply["recovered"] is True
    node = Node.objects.get(name=victim)
    assert node.status == NodeStatus.READY and node.status_reason == "heartbeat resumed"
    restored = dict(Device.objects.filter(node=node).values_list("uid", "worker__name"))
    assert restored == owners
    for device in Device.objects.filter(node=node):
        assert device.status == (DeviceStatus.ALLOCATED if device.worker_id else DeviceStatus.FREE)
    assert not WorkerGroup.objects.filter(flagged=True).exists()
    assert AuditEvent.objects.filter(verb="node.recover", actor=f"agent:{victim}").exists()


def test_a_drained_node_comes_back_drained(client: Client, bootstrap: str, settings: Settings) -> None:
    settings.NODE_LOST_AFTER_S = 30.0
    agent, _ = register(client, bootstrap, "node-d", gpus=1)
    Node.objects.filter(name="node-d").update(status=NodeStatus.DRAINED)
    silence("node-d", 60)
    liveness.detect_lost_nodes()
    assert Node.objects.get(name="node-d").status == NodeStatus.LOST
    assert agent.heartbeat({"sent_at": time.time()}).json()["node_status"] == NodeStatus.DRAINED


@pytest.mark.django_db(transaction=True)
def test_beat_task_marks_lost_nodes_through_a_real_worker(
    client: Client, bootstrap: str, celery_worker: Any
) -> None:
    from agents.tasks import detect_lost_nodes

    register(client, bootstrap, "node-gone", gpus=1)
    silence("node-gone", 3600)  # older than any configured NODE_LOST_AFTER_S
    detect_lost_nodes.delay()
    assert wait_until(lambda: Node.objects.get(name="node-gone").status == NodeStatus.LOST, timeout_s=30)
    assert Migration.objects.count() == 0


def summary() -> dict[str, Any]:
    return dict(ClusterSummarySerializer(cluster_summary()).data)


def test_lost_gpus_are_reported_never_admitted_and_come_back_free(
    cluster: tuple[dict[str, Agent], Job],
) -> None:
    agents, job = cluster
    waiting = submit(make_user("bob"), spec(rollout=8, actor=2))  # 10 GPUs: waits for the first job
    assert waiting.state == "pending"
    victim = sorted(n for n in agents if groups_on(n, job))[0]
    owned = Device.objects.filter(node__name=victim, worker__isnull=False).count()
    silence(victim, 120)
    assert liveness.detect_lost_nodes() == [victim]

    gpus = summary()["gpus"]
    # 12 GPUs: the job's 8, four free; all four of the victim's are lost now, owned or not.
    assert gpus["by_status"] == {"free": owned, "allocated": 8 - owned, "lost": 4}
    [entry] = gpus["by_job"]
    assert (entry["job"], entry["gpus"], entry["lost"]) == (job.pk, 8, owned)
    assert sum(c["lost"] for c in entry["components"]) == owned

    # The job ends while the node is away: the other nodes' devices are freed at once, the lost
    # node's when its agent reports the stop; they stay lost, so the waiting job cannot have them.
    job_services.cancel_job(job.pk, Actor.for_user(job.owner))
    run_everywhere({h: a for h, a in agents.items() if h != victim})
    run_everywhere({victim: agents[victim]})
    on_victim = Device.objects.filter(node__name=victim)
    assert set(on_victim.values_list("status", flat=True)) == {DeviceStatus.LOST}
    assert not on_victim.filter(worker__isnull=False).exists()
    assert admit_pending(actor=Actor.scheduler()) == []
    waiting.refresh_from_db()
    assert waiting.state == "pending"
    assert summary()["gpus"]["by_status"] == {"free": 8, "allocated": 0, "lost": 4}

    # Back: its devices are free again and the waiting job is admitted.
    assert agents[victim].heartbeat({"sent_at": time.time()}).json()["recovered"] is True
    assert set(on_victim.values_list("status", flat=True)) - {DeviceStatus.ALLOCATED} <= {DeviceStatus.FREE}
    waiting.refresh_from_db()
    assert waiting.state == "admitted"
    assert summary()["gpus"]["by_status"] == {"free": 2, "allocated": 10, "lost": 0}
