"""A running job placed anew (colocated <-> disaggregated) through the agents' own reports: its
workers stop, the devices they free stay the job's, the new layout launches on them, and a
failure on the way fails the job with a reason instead of leaving it half placed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from agents.services import progress
from cluster.models import AgentCommand, Device, Node, NodeStatus
from cluster.selectors import free_devices
from common import redis as common_redis
from common.audit import Actor
from common.models import AuditEvent
from jobs.models import Job, JobReason, JobState, Worker, WorkerState
from scheduler.core.policies.base import Placement
from scheduler.core.policies.replan import time_shared
from scheduler.models import PlacementChange, PlacementChangeState
from scheduler.services import gpu_migrations, placement_changes
from scheduler.services.gpu_migrations import ManualMigrationError
from scheduler.services.graph import build_hypergraph
from tests.agents.conftest import Agent, register
from tests.factories import make_user, spec, submit

pytestmark = pytest.mark.django_db


@dataclass(frozen=True)
class Change:
    placement: Placement
    detail: str


TO_COLOCATED = Change(Placement.COLOCATED, "colocated saves 31% (measured: no tail)")


@pytest.fixture
def agents(client: Any, bootstrap: str) -> dict[str, Agent]:
    return {host: register(client, bootstrap, host, gpus=4)[0] for host in ("node-a", "node-b")}


def commands(agents: dict[str, Agent], kind: str) -> dict[str, dict[str, Any]]:
    got = {}
    for name, agent in agents.items():
        for command in agent.fetch().json()["commands"]:
            if command["kind"] == kind:
                got[name] = command
    return got


def running_job(agents: dict[str, Agent], **components: Any) -> Job:
    job = submit(make_user("alice"), spec(**components))
    for host, command in commands(agents, "launch_workers").items():
        agents[host].report(command["command_id"], {"ok": True})
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    return job


def start(job: Job, change: Change = TO_COLOCATED) -> PlacementChange | str:
    locked = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
    return placement_changes.start(locked, change, actor=Actor.scheduler())


def test_a_job_is_placed_colocated_on_its_own_devices_and_no_other_job_takes_them_in_between(
    agents: dict[str, Agent],
) -> None:
    job = running_job(agents, rollout=6, actor=2)
    before = set(Device.objects.filter(worker__group__job=job).values_list("uid", flat=True))
    old = set(Worker.objects.filter(group__job=job).values_list("name", flat=True))
    change = start(job)
    assert isinstance(change, PlacementChange) and change.state == PlacementChangeState.STOPPING
    assert set(change.old_workers) == old
    assert set(Worker.objects.filter(name__in=old).values_list("state", flat=True)) == {WorkerState.STOPPING}
    stops = commands(agents, "stop_workers")
    assert set(stops) == {"node-a", "node-b"}
    # The iteration that has just begun is redone by the new layout: the nodes void their part of
    # it, and the control plane forgets how it was split and what the nodes reported.
    assert {c["payload"]["redo_from_iteration"] for c in stops.values()} == {job.iteration}
    scope = progress.scope_of(job)
    redis = common_redis.shared_client()
    split = progress.partition_key(scope, job.iteration)
    claimed = progress.claims_key(scope, job.iteration, "rollout")
    redis.set(split, '{"rollout": ["j1-rollout-w0"]}')
    redis.sadd(claimed, "j1-rollout-w0")
    redis.hset(progress.nodes_key(scope), "node-a", "{}")

    # One node has stopped its workers: what they freed stays the job's, though another job waits.
    agents["node-a"].report(stops["node-a"]["command_id"], {"ok": True})
    waiting = submit(make_user("bob"), spec("other", rollout=1, actor=1))
    waiting.refresh_from_db()
    assert waiting.state == JobState.PENDING
    assert not free_devices().filter(node__name="node-a").exists()
    assert set(
        Device.objects.filter(reserved_by=change.reservation).values_list("node__name", flat=True)
    ) == {"node-a"}

    # All have stopped: every group gets workers on all eight devices, time-shared.
    agents["node-b"].report(stops["node-b"]["command_id"], {"ok": True})
    change.refresh_from_db()
    assert change.state == PlacementChangeState.LAUNCHING
    launches = commands(agents, "launch_workers")
    payloads = [w for command in launches.values() for w in command["payload"]["workers"]]
    assert {w["worker"] for w in payloads} == set(change.new_workers)
    assert {w["group"] for w in payloads} == {"rollout", "actor"}
    for group in ("rollout", "actor"):
        held = {d["uid"] for w in payloads if w["group"] == group for d in w["devices"]}
        assert held == before
    assert all(d["shared"] for w in payloads for d in w["devices"])
    assert not Device.objects.filter(reserved_by=change.reservation).exists()
    assert not redis.exists(split, claimed, progress.nodes_key(scope))

    for host, command in launches.items():
        agents[host].report(command["command_id"], {"ok": True})
    change.refresh_from_db()
    job.refresh_from_db()
    assert change.state == PlacementChangeState.DONE and change.finished_at is not None
    assert job.state == JobState.RUNNING
    assert time_shared(build_hypergraph(job))
    verbs = list(
        AuditEvent.objects.filter(job=job, verb__startswith="placement_change")
        .order_by("at")
        .values_list("verb")
    )
    assert verbs == [
        ("placement_change.started",),
        ("placement_change.launching",),
        ("placement_change.done",),
    ]
    # What each node said as it stopped the old layout is kept with the trail.
    launching = AuditEvent.objects.get(job=job, verb="placement_change.launching")
    assert launching.payload["stop_reports"] == {"node-a": {}, "node-b": {}}
    waiting.refresh_from_db()
    assert waiting.state == JobState.PENDING  # the cluster is full: nothing was freed


def test_back_to_disaggregated_the_spec_split_is_restored(agents: dict[str, Agent]) -> None:
    job = running_job(agents, rollout=6, actor=2)
    for change in (TO_COLOCATED, Change(Placement.DISAGGREGATED, "the tail is back")):
        row = start(job, change)
        assert isinstance(row, PlacementChange)
        for host, command in commands(agents, "stop_workers").items():
            agents[host].report(command["command_id"], {"ok": True})
        for host, command in commands(agents, "launch_workers").items():
            agents[host].report(command["command_id"], {"ok": True})
        row.refresh_from_db()
        assert row.state == PlacementChangeState.DONE
    graph = build_hypergraph(job)
    assert not time_shared(graph)
    assert {n.id: n.gpus for n in graph.nodes} == {"rollout": 6, "actor": 2}
    assert not Worker.objects.filter(
        group__job=job, colocated_devices__isnull=False, state="running"
    ).exists()


def test_a_colocated_trainer_spans_the_largest_of_its_valid_sizes_and_the_job_counts_as_colocated(
    agents: dict[str, Agent],
) -> None:
    job = running_job(agents, rollout=6, actor=2)
    job.groups.filter(name="actor").update(valid_dp=[2, 4, 6])
    change = start(job)
    assert isinstance(change, PlacementChange)
    assert len(change.layout["actor"]) == 6 and len(change.layout["rollout"]) == 8
    for kind in ("stop_workers", "launch_workers"):
        for host, command in commands(agents, kind).items():
            agents[host].report(command["command_id"], {"ok": True})
    change.refresh_from_db()
    assert change.state == PlacementChangeState.DONE
    graph = build_hypergraph(job)
    assert graph.node("actor").gpus == 6 and graph.node("rollout").gpus == 8
    assert time_shared(graph)


def test_a_layout_outside_the_operators_limits_is_refused_and_nothing_changes(
    agents: dict[str, Agent],
) -> None:
    job = running_job(agents, rollout=6, actor=2)
    job.groups.filter(name="actor").update(valid_dp=[16])
    why = start(job)
    assert why == "actor: 8 workers is not a valid data-parallel size [16]"
    assert not PlacementChange.objects.exists()
    assert set(Worker.objects.filter(group__job=job).values_list("state", flat=True)) == {WorkerState.RUNNING}
    assert not AgentCommand.objects.filter(kind="stop_workers").exists()


def test_a_new_worker_that_fails_to_start_fails_the_job_and_the_change(agents: dict[str, Agent]) -> None:
    job = running_job(agents, rollout=6, actor=2)
    change = start(job)
    assert isinstance(change, PlacementChange)
    for host, command in commands(agents, "stop_workers").items():
        agents[host].report(command["command_id"], {"ok": True})
    launches = commands(agents, "launch_workers")
    agents["node-a"].report(launches["node-a"]["command_id"], {"ok": False, "error": "engine OOM at start"})
    change.refresh_from_db()
    job.refresh_from_db()
    assert change.state == PlacementChangeState.FAILED and "failed to start" in change.error
    assert (job.state, job.state_reason) == (JobState.FAILED, JobReason.WORKER_FAILED)
    assert "engine OOM at start" in job.state_detail
    assert not Device.objects.filter(reserved_by=change.reservation).exists()


@override_settings(PLACEMENT_CHANGE_TIMEOUT_S=0.0)
def test_a_change_whose_workers_never_stop_fails_the_job_with_a_reason(agents: dict[str, Agent]) -> None:
    job = running_job(agents, rollout=6, actor=2)
    change = start(job)
    assert isinstance(change, PlacementChange)
    locked = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
    assert placement_changes.fail_if_stuck(change, now=timezone.now())
    change.refresh_from_db()
    locked.refresh_from_db()
    assert change.state == PlacementChangeState.FAILED
    assert (locked.state, locked.state_reason) == (JobState.FAILED, JobReason.PLACEMENT_CHANGE_FAILED)
    assert "did not finish within 0 s (stopping)" in locked.state_detail


def test_an_operators_move_waits_for_the_change_and_a_change_needs_every_node_ready(
    agents: dict[str, Agent],
) -> None:
    job = running_job(agents, rollout=6, actor=2)
    Node.objects.filter(name="node-b").update(status=NodeStatus.LOST)
    assert start(job) == "node node-b is not ready: its workers could not be stopped and started again"
    Node.objects.filter(name="node-b").update(status=NodeStatus.READY)
    assert isinstance(start(job), PlacementChange)
    with pytest.raises(ManualMigrationError, match="the job is being placed anew"):
        gpu_migrations.request_manual_migration(
            job.pk, donor="rollout", recipient="actor", workers=1, actor=Actor.system("operator")
        )
