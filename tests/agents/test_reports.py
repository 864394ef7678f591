"""Reports: launch and stop move workers, jobs and devices; step reports drive migrations;
repeats change nothing; a node reports only its own commands."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from django.test import Client

from cluster.models import AgentCommand, CommandState, Device, DeviceStatus
from common.audit import Actor
from common.models import AuditEvent
from jobs import services as job_services
from jobs.models import Job, JobReason, JobState, JobTransition, Worker, WorkerState
from scheduler.models import MigrationStep, StepState
from scheduler.services import gpu_migrations
from tests.agents.conftest import Agent, register
from tests.factories import make_user, spec, submit

pytestmark = pytest.mark.django_db


def launch_commands(agents: dict[str, Agent]) -> dict[str, dict[str, Any]]:
    """Each agent fetches; node name -> its launch command."""
    got = {}
    for name, agent in agents.items():
        for command in agent.fetch().json()["commands"]:
            if command["kind"] == "launch_workers":
                got[name] = command
    return got


def state_of(job: Job) -> tuple[str, str]:
    job.refresh_from_db()
    return job.state, job.state_reason


@pytest.fixture
def two_nodes(client: Client, bootstrap: str) -> dict[str, Agent]:
    return {host: register(client, bootstrap, host, gpus=4)[0] for host in ("node-a", "node-b")}


def test_launch_reports_move_the_job_to_running(two_nodes: dict[str, Agent]) -> None:
    job = submit(make_user("alice"), spec(rollout=6, actor=2))  # 8 GPUs: both nodes
    commands = launch_commands(two_nodes)
    assert set(commands) == {"node-a", "node-b"}
    assert state_of(job) == (JobState.ADMITTED, JobReason.ADMITTED)

    first = two_nodes["node-a"].report(
        commands["node-a"]["command_id"], {"ok": True, "result": {"pids": [1, 2]}}
    )
    assert first.status_code == 200 and first.json()["state"] == "done" and first.json()["repeated"] is False
    names_a = {w["worker"] for w in commands["node-a"]["payload"]["workers"]}
    assert set(Worker.objects.filter(state=WorkerState.RUNNING).values_list("name", flat=True)) == names_a
    assert state_of(job) == (JobState.ADMITTED, JobReason.ADMITTED)  # node-b's workers still start

    two_nodes["node-b"].report(commands["node-b"]["command_id"], {"ok": True})
    assert state_of(job) == (JobState.RUNNING, JobReason.WORKERS_LAUNCHED)
    assert not Worker.objects.exclude(state=WorkerState.RUNNING).exists()
    transition = JobTransition.objects.filter(job=job).last()
    assert transition is not None and (transition.to_state, transition.actor) == ("running", "agent:node-b")
    reports = AuditEvent.objects.filter(verb="agent.command.report", job=job)
    assert sorted(reports.values_list("actor", flat=True)) == ["agent:node-a", "agent:node-b"]


def test_repeated_report_is_a_no_op(two_nodes: dict[str, Agent]) -> None:
    submit(make_user("alice"), spec(rollout=2, actor=2))
    [(host, command)] = launch_commands(two_nodes).items()
    agent = two_nodes[host]
    first = agent.report(command["command_id"], {"ok": True, "result": {"pids": [7]}}).json()

    def snapshot() -> tuple[object, ...]:
        return (
            list(AgentCommand.objects.values_list("command_id", "state", "finished_at", "result")),
            list(Worker.objects.order_by("pk").values_list("name", "state", "started_at")),
            list(Job.objects.values_list("state", "state_reason")),
            AuditEvent.objects.count(),
            JobTransition.objects.count(),
        )

    before = snapshot()
    again = agent.report(command["command_id"], {"ok": True, "result": {"pids": [7]}}).json()
    contradicting = agent.report(command["command_id"], {"ok": False, "error": "late failure"}).json()
    assert snapshot() == before
    assert again == {**first, "repeated": True} and contradicting == again
    assert again["result"]["result"] == {"pids": [7]}


def test_a_node_cannot_report_another_nodes_command(two_nodes: dict[str, Agent]) -> None:
    submit(make_user("alice"), spec(rollout=2, actor=2))
    [(host, command)] = launch_commands(two_nodes).items()
    stranger = two_nodes["node-b" if host == "node-a" else "node-a"]
    response = stranger.report(command["command_id"], {"ok": False, "error": "not mine"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
    stored = AgentCommand.objects.get(command_id=command["command_id"])
    assert stored.state == CommandState.DELIVERED and stored.result == {}
    assert not Worker.objects.exclude(state=WorkerState.STARTING).exists()
    missing = stranger.report("no-such-command", {"ok": True})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_stop_reports_free_devices_and_admit_a_waiting_job(client: Client, bootstrap: str) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=4)
    owner = make_user("alice")
    first = submit(owner, spec("first", rollout=2, actor=2))
    [launch] = agent.fetch().json()["commands"]
    agent.report(launch["command_id"], {"ok": True})
    assert state_of(first)[0] == JobState.RUNNING
    waiting = submit(owner, spec("waiting", rollout=2, actor=2))
    assert state_of(waiting) == (JobState.PENDING, JobReason.WAITING_FOR_DEVICES)

    job_services.cancel_job(first.pk, Actor.for_user(owner))
    assert set(Worker.objects.filter(group__job=first).values_list("state", flat=True)) == {
        WorkerState.STOPPING
    }
    assert set(Device.objects.values_list("status", flat=True)) == {DeviceStatus.ALLOCATED}
    [stop] = agent.fetch().json()["commands"]
    assert stop["kind"] == "stop_workers"

    assert agent.report(stop["command_id"], {"ok": True}).json()["state"] == "done"

    assert set(Worker.objects.filter(group__job=first).values_list("state", flat=True)) == {
        WorkerState.STOPPED
    }
    assert state_of(waiting)[0] == JobState.ADMITTED
    assert set(Device.objects.values_list("worker__group__job", flat=True)) == {waiting.pk}
    [next_launch] = agent.fetch().json()["commands"]
    assert next_launch["kind"] == "launch_workers" and next_launch["payload"]["job"] == waiting.pk


def test_failed_stop_keeps_devices(client: Client, bootstrap: str) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=4)
    owner = make_user("alice")
    job = submit(owner, spec(rollout=2, actor=2))
    [launch] = agent.fetch().json()["commands"]
    agent.report(launch["command_id"], {"ok": True})
    job_services.cancel_job(job.pk, Actor.for_user(owner))
    [stop] = agent.fetch().json()["commands"]
    stuck = stop["payload"]["workers"][0]
    body = {"ok": True, "workers": {stuck: {"ok": False, "error": "process will not exit"}}}
    assert agent.report(stop["command_id"], body).json()["state"] == "failed"
    assert Worker.objects.get(name=stuck).state == WorkerState.STOPPING
    assert Device.objects.get(worker__name=stuck).status == DeviceStatus.ALLOCATED
    assert Device.objects.filter(status=DeviceStatus.FREE).count() == 3


def test_failed_launch_fails_the_job_and_releases_it(client: Client, bootstrap: str) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=4)
    job = submit(make_user("alice"), spec(rollout=2, actor=2))
    [launch] = agent.fetch().json()["commands"]
    broken = launch["payload"]["workers"][0]["worker"]
    body = {"ok": True, "workers": {broken: {"ok": False, "error": "CUDA out of memory"}}}
    assert agent.report(launch["command_id"], body).json()["state"] == "failed"
    assert state_of(job) == (JobState.FAILED, JobReason.WORKER_FAILED)
    assert "CUDA out of memory" in Job.objects.get(pk=job.pk).state_detail
    assert Worker.objects.get(name=broken).state == WorkerState.FAILED
    assert not Device.objects.filter(worker__name=broken).exists()
    others = Worker.objects.filter(group__job=job).exclude(name=broken)
    assert set(others.values_list("state", flat=True)) == {WorkerState.STOPPING}
    [stop] = agent.fetch().json()["commands"]
    assert stop["kind"] == "stop_workers" and set(stop["payload"]["workers"]) == set(
        others.values_list("name", flat=True)
    )


def test_step_reports_drive_the_migration(client: Client, bootstrap: str) -> None:
    agents = {host: register(client, bootstrap, host, gpus=4)[0] for host in ("node-a", "node-b")}
    owner = make_user("alice")
    job = submit(owner, spec(rollout=6, actor=2))
    for host, command in launch_commands(agents).items():
        agents[host].report(command["command_id"], {"ok": True})
    assert state_of(job)[0] == JobState.RUNNING
    migration = gpu_migrations.request_manual_migration(
        job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(owner)
    )
    for _ in range(100):
        fetched = {host: agent.fetch().json()["commands"] for host, agent in agents.items()}
        if not any(fetched.values()):
            break
        for host, commands in fetched.items():
            for command in commands:
                assert command["kind"] == "migration_step"
                reply = agents[host].report(command["command_id"], {"ok": True, "result": {"took_s": 0.1}})
                assert reply.status_code == 200 and reply.json()["state"] == "done"
                again = agents[host].report(command["command_id"], {"ok": False, "error": "late"})
                assert again.json()["repeated"] is True and again.json()["state"] == "done"
    migration.refresh_from_db()
    assert migration.state == "committed"
    assert set(MigrationStep.objects.filter(migration=migration).values_list("state", flat=True)) == {
        StepState.DONE
    }
    assert AuditEvent.objects.filter(verb="migration.step.report", actor__startswith="agent:").exists()


def first_step_command(client: Client, bootstrap: str) -> tuple[dict[str, Agent], AgentCommand]:
    """Two registered nodes running a job, a one-worker rollout -> actor migration requested:
    the agents and the migration's first step command."""
    agents = {host: register(client, bootstrap, host, gpus=4)[0] for host in ("node-a", "node-b")}
    owner = make_user("alice")
    job = submit(owner, spec(rollout=6, actor=2))
    for host, command in launch_commands(agents).items():
        agents[host].report(command["command_id"], {"ok": True})
    gpu_migrations.request_manual_migration(
        job.pk, donor="rollout", recipient="actor", workers=1, actor=Actor.for_user(owner)
    )
    command = AgentCommand.objects.filter(kind="migration_step").select_related("node").first()
    assert command is not None
    return agents, command


def test_step_report_by_step_id(client: Client, bootstrap: str) -> None:
    agents, command = first_step_command(client, bootstrap)
    step_id, attempt = command.payload["step"]["step_id"], command.payload["attempt"]
    mine, other = agents[command.node.name], agents["node-b" if command.node.name == "node-a" else "node-a"]
    url = f"/api/v1/agent/steps/{quote(step_id, safe='')}/report"
    assert MigrationStep.objects.get(step_id=step_id).nodes == [command.node.name]  # one worker pauses
    refused = other.post(url, {"ok": True, "attempt": attempt})
    assert refused.status_code == 403
    unknown = mine.post(f"/api/v1/agent/steps/{quote('m0:00:nothing', safe='')}/report", {"ok": True})
    assert unknown.status_code == 404
    done = mine.post(url, {"ok": True, "attempt": attempt}).json()
    assert done["command_id"] == command.command_id and done["state"] == "done" and not done["repeated"]
    assert MigrationStep.objects.get(step_id=step_id).state == StepState.DONE
    assert mine.post(url, {"ok": True, "attempt": attempt}).json()["repeated"] is True


def test_bad_report_names_fields(two_nodes: dict[str, Agent]) -> None:
    submit(make_user("alice"), spec(rollout=2, actor=2))
    [(host, command)] = launch_commands(two_nodes).items()
    response = two_nodes[host].report(
        command["command_id"], {"ok": "yes", "result": [], "workers": {"w": {}}}
    )
    assert response.status_code == 400
    assert {f["path"] for f in response.json()["error"]["fields"]} == {"ok", "result", "workers.w.ok"}
    assert AgentCommand.objects.get(command_id=command["command_id"]).state == CommandState.DELIVERED


def test_a_step_report_carrying_megabytes_of_requests_is_taken_and_one_over_the_limit_is_413(
    client: Client, bootstrap: str, settings: Any
) -> None:
    """A rollout that hands over its queue reports every request: bigger than the 2.5 MB a
    browser form may post, well within what agents may send."""
    agents, command = first_step_command(client, bootstrap)
    agent = agents[command.node.name]
    requests = [
        {"episode": k, "iteration": 0, "context_tokens": 512, "from": "w" * 200} for k in range(16_384)
    ]
    body = {"ok": True, "result": {"requests": requests}}
    settings.AGENT_MAX_BODY_BYTES = 1_000_000
    refused = agent.report(command.command_id, body)
    assert refused.status_code == 413
    assert "at most 1000000" in refused.json()["error"]["message"]
    assert AgentCommand.objects.get(pk=command.pk).state == command.state, "nothing recorded"
    settings.AGENT_MAX_BODY_BYTES = 64 * 1024 * 1024
    taken = agent.report(command.command_id, body)
    assert taken.status_code == 200 and taken.json()["state"] == "done"
    step = MigrationStep.objects.get(step_id=command.payload["step"]["step_id"])
    stored = step.result["attempts"][str(step.attempts)][command.node.name]["result"]["requests"]
    assert len(stored) == 16_384
