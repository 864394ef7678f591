"""The agent daemon as a real process against a real control plane (daphne, PostgreSQL, Redis):
registration and heartbeats, launches, migration steps, crashes, outages, SIGTERM and 401s."""

from __future__ import annotations

import json
import os
import stat
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.db.models import Sum
from django.utils import timezone

from agents.auth import issue_node_token
from agents.models import BootstrapToken, NodeToken
from cluster.models import AgentCommand, CommandState, Device, Node, NodeStatus
from common.audit import Actor
from common.models import AuditEvent, hash_token
from jobs.models import Job, JobState, Worker, WorkerState
from scheduler.models import Migration, MigrationStep, StepState, TelemetrySample
from scheduler.services import gpu_migrations
from tests.agent_daemon.conftest import AgentProcess, LiveServer
from tests.factories import make_user, ray_spec, spec, submit
from tests.services import free_port, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TERMINAL_MIGRATION_STATES = ("committed", "rolled_back", "failed")


def eventually(predicate: Callable[[], bool], agent: AgentProcess, what: str, timeout_s: float = 60) -> None:
    assert wait_until(predicate, timeout_s=timeout_s), (
        f"{what}\n--- agent log ---\n{agent.log_text()[-6000:]}\n--- server log ---\n"
        f"{agent.server.log_text()[-3000:]}"
    )


def registered(agent: AgentProcess) -> Node:
    eventually(
        lambda: Device.objects.filter(node__name=agent.host, reported_at__isnull=False).count() == 4,
        agent,
        "the agent never registered and heartbeated",
    )
    return Node.objects.get(name=agent.host)


def job_state(job: Job) -> str:
    job.refresh_from_db()
    return job.state


def running_job(agent: AgentProcess) -> Job:
    owner = make_user("alice")
    job = submit(owner, spec(rollout=2, actor=2))  # all four GPUs of the node
    eventually(lambda: job_state(job) == JobState.RUNNING, agent, "the job never started running")
    return job


def migrate(job: Job) -> Migration:
    return gpu_migrations.request_manual_migration(
        job.pk, donor="rollout", recipient="actor", workers=1, actor=Actor.for_user(job.owner)
    )


def migration_state(migration: Migration) -> str:
    migration.refresh_from_db()
    return migration.state


def stored_token(agent: AgentProcess) -> str:
    token = json.loads((agent.state_dir / "node-token.json").read_text())["token"]
    assert isinstance(token, str)
    return token


def journal_events(agent: AgentProcess) -> list[dict[str, Any]]:
    path = agent.state_dir / "journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_registers_heartbeats_and_keeps_its_token_private(agent: AgentProcess) -> None:
    agent.start()
    node = registered(agent)

    assert node.status == NodeStatus.READY and node.backend == "sim"
    assert sorted(Device.objects.filter(node=node).values_list("index", "hardware")) == [
        (i, "H100") for i in range(4)
    ]
    token_file = agent.state_dir / "node-token.json"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert hash_token(stored_token(agent)) == NodeToken.objects.get(node=node).key_hash
    # The backend sees the control plane's replies (the first heartbeat's may still be on its way
    # when the registration is stored).
    eventually(
        lambda: any(c["node_status"] == "ready" for c in agent.calls("observe_control")),
        agent,
        "the backend saw no control reply with its node ready",
    )


def test_a_launch_is_carried_out_and_reported(agent: AgentProcess) -> None:
    agent.start()
    registered(agent)
    job = running_job(agent)

    names = set(Worker.objects.filter(group__job=job).values_list("name", flat=True))
    assert set(Worker.objects.filter(group__job=job).values_list("state", flat=True)) == {WorkerState.RUNNING}
    [launch] = agent.calls("launch_workers")
    assert set(launch["workers"]) == names and launch["job"] == job.pk and launch["spec_name"] == "math-small"
    command = AgentCommand.objects.get(kind="launch_workers")
    assert command.state == CommandState.DONE
    assert AuditEvent.objects.filter(verb="agent.command.report", actor=f"agent:{agent.host}").exists()
    # The workers' telemetry reaches the history.
    eventually(
        lambda: set(TelemetrySample.objects.filter(job_id=job.pk).values_list("worker", flat=True)) == names,
        agent,
        "no telemetry rows for the launched workers",
    )


def test_a_command_finished_before_a_crash_is_not_carried_out_again(
    agent: AgentProcess, server: LiveServer
) -> None:
    agent.start(hold_launch=True)
    registered(agent)
    job = submit(make_user("alice"), spec(rollout=2, actor=2))
    eventually(lambda: len(agent.calls("launch_workers")) == 1, agent, "the launch never reached the backend")
    command_id = AgentCommand.objects.get(kind="launch_workers").command_id

    # The control plane goes away; the launch finishes and is journaled, but cannot be reported...
    server.stop()
    agent.hold_launch.touch()
    eventually(
        lambda: any(
            e["event"] == "finished" and e["command_id"] == command_id for e in journal_events(agent)
        ),
        agent,
        "the launch's outcome was never journaled",
    )
    # ...and the agent dies before it could.
    agent.kill()
    assert AgentCommand.objects.get(command_id=command_id).state == CommandState.DELIVERED

    server.start()
    agent.start()
    eventually(lambda: job_state(job) == JobState.RUNNING, agent, "the recorded launch was never reported")

    assert len(agent.calls("launch_workers")) == 1  # once, by the first process
    assert AgentCommand.objects.get(command_id=command_id).state == CommandState.DONE
    assert AuditEvent.objects.filter(verb="node.reregister", actor=f"agent:{agent.host}").count() == 1
    assert any(e["event"] == "reported" and e["command_id"] == command_id for e in journal_events(agent))


def test_a_redelivered_command_is_reported_from_the_journal_not_run_again(agent: AgentProcess) -> None:
    agent.start()
    registered(agent)
    job = running_job(agent)
    command = AgentCommand.objects.get(kind="launch_workers")

    # The control plane loses the report (say, its database is restored from before it) and
    # hands the command out again.
    Worker.objects.filter(group__job=job).update(state=WorkerState.STARTING)
    Job.objects.filter(pk=job.pk).update(state=JobState.ADMITTED)
    AgentCommand.objects.filter(pk=command.pk).update(state=CommandState.QUEUED, finished_at=None)
    eventually(
        lambda: AgentCommand.objects.get(pk=command.pk).state == CommandState.DONE,
        agent,
        "the redelivered command was never reported",
    )

    assert AgentCommand.objects.get(pk=command.pk).deliveries == 2
    assert len(agent.calls("launch_workers")) == 1
    assert set(Worker.objects.filter(group__job=job).values_list("state", flat=True)) == {WorkerState.RUNNING}
    assert "carried out already" in agent.log_text()


def test_an_outage_is_survived_and_the_step_reported_afterwards(
    agent: AgentProcess, server: LiveServer
) -> None:
    agent.start(hold_steps=True)
    registered(agent)
    job = running_job(agent)
    migration = migrate(job)
    eventually(
        lambda: len(agent.calls("execute_step")) == 1, agent, "the first step never reached the backend"
    )
    [held] = agent.calls("execute_step")

    server.stop()
    agent.hold_steps.touch()  # the step finishes while the control plane is down
    eventually(lambda: len(agent.calls("step_done")) == 1, agent, "the step never finished")
    eventually(
        lambda: f"report of {held['step_id']}" in agent.log_text(),
        agent,
        "the report was never attempted during the outage",
    )
    assert MigrationStep.objects.get(step_id=held["step_id"]).state == StepState.RUNNING

    server.start()
    eventually(
        lambda: migration_state(migration) in TERMINAL_MIGRATION_STATES,
        agent,
        "the migration never finished",
    )

    assert migration.state == "committed"
    assert MigrationStep.objects.get(step_id=held["step_id"]).state == StepState.DONE
    executed = Counter((c["step_id"], c["attempt"]) for c in agent.calls("execute_step"))
    assert executed and set(executed.values()) == {1}  # every step once, none repeated
    assert agent.running()


def test_telemetry_buffered_through_an_outage_arrives_exactly_once(
    agent: AgentProcess, server: LiveServer
) -> None:
    agent.start()
    registered(agent)
    job = running_job(agent)

    server.stop()
    during = len(agent.calls("telemetry"))
    eventually(lambda: len(agent.calls("telemetry")) >= during + 10, agent, "no telemetry during the outage")
    server.start()
    eventually(lambda: "heartbeat failed" in agent.log_text(), agent, "the outage went unnoticed")
    agent.signal()
    assert agent.wait() == 0

    produced = Counter(name for call in agent.calls("telemetry") for name in call["workers"])
    stored = dict(
        TelemetrySample.objects.filter(job_id=job.pk)
        .values_list("worker")
        .annotate(total=Sum("samples"))
        .values_list("worker", "total")
    )
    assert stored == dict(produced)


def test_sigterm_sends_the_last_heartbeat_closes_the_backend_and_exits_0(agent: AgentProcess) -> None:
    agent.start()
    node = registered(agent)
    agent.signal()
    assert agent.wait() == 0

    last = [c["call"] for c in agent.calls() if c["call"] in ("telemetry", "observe_control", "close")][-3:]
    assert last == ["telemetry", "observe_control", "close"]  # the final telemetry was delivered
    assert "stopped cleanly" in agent.log_text()
    node.refresh_from_db()
    assert node.status == NodeStatus.READY


def test_sigterm_finishes_the_step_in_hand(agent: AgentProcess) -> None:
    agent.start(hold_steps=True)
    registered(agent)
    migration = migrate(running_job(agent))
    eventually(
        lambda: len(agent.calls("execute_step")) == 1, agent, "the first step never reached the backend"
    )
    [held] = agent.calls("execute_step")

    agent.signal()
    time.sleep(0.5)
    assert agent.running()  # waiting for the step
    agent.hold_steps.touch()
    assert agent.wait() == 0

    assert MigrationStep.objects.get(step_id=held["step_id"]).state == StepState.DONE
    # No further step was started once stopping.
    assert len(agent.calls("execute_step")) == 1
    assert migration_state(migration) == "running"


def test_sigterm_reports_a_step_it_cannot_finish_failed(agent: AgentProcess) -> None:
    agent.start(hold_steps=True, DYNARL_SHUTDOWN_GRACE_S="1")
    registered(agent)
    migration = migrate(running_job(agent))
    eventually(
        lambda: len(agent.calls("execute_step")) == 1, agent, "the first step never reached the backend"
    )
    [held] = agent.calls("execute_step")

    agent.signal()
    assert agent.wait() == 0

    step = MigrationStep.objects.get(step_id=held["step_id"])
    assert step.state == StepState.FAILED and "shutting down" in step.error
    assert migration_state(migration) in ("rolling_back", "rolled_back")
    assert not agent.calls("step_done")
    assert AuditEvent.objects.filter(
        verb="migration.step.report", actor=f"agent:{agent.host}", payload__ok=False
    ).exists()


def test_a_step_interrupted_by_a_crash_is_reported_failed_not_run_again(agent: AgentProcess) -> None:
    agent.start(hold_steps=True)
    registered(agent)
    migration = migrate(running_job(agent))
    eventually(
        lambda: len(agent.calls("execute_step")) == 1, agent, "the first step never reached the backend"
    )
    [held] = agent.calls("execute_step")
    agent.kill()

    agent.start()  # registers again; the control plane hands the step out again
    eventually(
        lambda: migration_state(migration) in TERMINAL_MIGRATION_STATES,
        agent,
        "the migration never finished",
    )

    assert migration.state == "rolled_back"
    assert MigrationStep.objects.get(step_id=held["step_id"]).state == StepState.ROLLED_BACK
    [report] = AuditEvent.objects.filter(verb="migration.step.report", payload__step=held["step_id"])
    assert report.payload["ok"] is False and "agent stopped while carrying this step out" in report.reason
    runs = [c for c in agent.calls("execute_step") if c["step_id"] == held["step_id"]]
    assert [c["pid"] for c in runs] == [held["pid"]]  # the new process did not run it again
    # The compensations ran on the new process.
    assert any(c["pid"] != held["pid"] for c in agent.calls("execute_step"))


@pytest.mark.parametrize("mode", ["crash", "fail"])
def test_a_fault_drill_crashes_the_agent_after_a_step_or_fails_the_step(
    agent: AgentProcess, mode: str
) -> None:
    """``--faults`` works with any backend: ``crash`` kills the agent once the backend has carried
    the step out and before its outcome is recorded, so the restarted agent reports it
    interrupted; ``fail`` fails it without calling the backend. Either way the migration rolls
    back and the agent's next process runs without the drill."""
    agent.start(DYNARL_AGENT_FAULTS=f"{mode}:pause_workers@1")
    registered(agent)
    migration = migrate(running_job(agent))
    if mode == "crash":
        eventually(lambda: not agent.running(), agent, "the drill's crash never happened")
        assert agent.wait() == 70
        [ran] = agent.calls("execute_step")  # carried out once, by the crashed process
        assert ran["kind"] == "pause_workers"
        agent.start()
    eventually(
        lambda: migration_state(migration) in TERMINAL_MIGRATION_STATES, agent, "the migration never finished"
    )
    assert migration.state == "rolled_back"
    paused = MigrationStep.objects.get(migration=migration, kind="pause_workers", is_rollback=False)
    [report] = AuditEvent.objects.filter(verb="migration.step.report", payload__step=paused.step_id)
    expected = "agent stopped while carrying this step out" if mode == "crash" else "injected fault fail:"
    assert report.payload["ok"] is False and expected in report.reason, report.reason
    pauses = [c for c in agent.calls("execute_step") if c["kind"] == "pause_workers"]
    assert len(pauses) == (1 if mode == "crash" else 0)


def test_a_fault_file_arms_the_running_agent_without_a_restart(agent: AgentProcess) -> None:
    """``--faults-file``: the agent reads the file before every step, so a drill written while it
    runs kills it in the step named, and the file emptied lets the next process run on."""
    faults = agent.workdir / "faults"
    agent.start(DYNARL_AGENT_FAULTS_FILE=str(faults))
    registered(agent)
    job = running_job(agent)
    pid = agent.pid
    faults.write_text("crash:pause_workers@1\n")
    migration = migrate(job)
    eventually(lambda: not agent.running(), agent, "the armed crash never happened")
    assert agent.wait() == 70
    [ran] = agent.calls("execute_step")
    assert (ran["kind"], ran["pid"]) == ("pause_workers", pid)  # the process started before arming
    faults.write_text("")
    agent.start(DYNARL_AGENT_FAULTS_FILE=str(faults))
    eventually(
        lambda: migration_state(migration) in TERMINAL_MIGRATION_STATES, agent, "the migration never finished"
    )
    assert migration.state == "rolled_back"
    assert agent.running()  # the new process ran the compensations and lives on


def test_a_restarted_agent_launches_the_workers_the_control_plane_has_running(agent: AgentProcess) -> None:
    agent.start()
    registered(agent)
    job = running_job(agent)
    names = sorted(Worker.objects.filter(group__job=job).values_list("name", flat=True))
    agent.kill()  # the host's workers die with it (RecordingBackend keeps them in memory)

    agent.start()
    eventually(lambda: len(agent.calls("launch_workers")) == 2, agent, "the workers were not launched again")
    relaunch = agent.calls("launch_workers")[-1]
    assert sorted(relaunch["workers"]) == names and relaunch["pid"] == agent.pid
    assert relaunch["spec_name"] == "math-small"
    # Their telemetry flows again from the new process.
    eventually(
        lambda: any(
            c["pid"] == agent.pid and sorted(c["workers"]) == names for c in agent.calls("telemetry")
        ),
        agent,
        "the new process does not report the workers",
    )
    assert job_state(job) == JobState.RUNNING


def test_the_sim_backend_runs_a_job_through_the_daemon(agent: AgentProcess) -> None:
    agent.start(DYNARL_BACKEND="sim", DYNARL_BACKEND_OPTIONS="gpus=4,hardware=H100,speed=20,seed=1")
    node = registered(agent)
    assert node.backend == "sim"
    job = running_job(agent)

    # The simulated host runs the launched workers and reports them.
    names = set(Worker.objects.filter(group__job=job).values_list("name", flat=True))
    eventually(
        lambda: set(TelemetrySample.objects.filter(job_id=job.pk).values_list("worker", flat=True)) == names,
        agent,
        "the simulated workers never reported",
    )
    assert Device.objects.filter(node=node, reported_at__isnull=False).count() == 4
    agent.signal()
    assert agent.wait() == 0


def test_the_agent_registers_the_job_backends_its_backend_runs(agent: AgentProcess) -> None:
    options = {"record": str(agent.record), "gpus": 4, "offers": ["sim", "ray"]}
    agent.start(DYNARL_BACKEND_OPTIONS=json.dumps(options))
    node = registered(agent)
    assert (node.backend, node.backends) == ("sim", ["sim", "ray"])
    # Admission takes the agent at its word: a ray job runs here.
    job = submit(make_user("alice"), ray_spec(rollout=1, actor=2))
    eventually(lambda: job_state(job) == JobState.RUNNING, agent, "the ray job never started running")
    agent.signal()
    assert agent.wait() == 0


def test_a_refused_node_token_makes_the_agent_register_again(agent: AgentProcess) -> None:
    agent.start()
    node = registered(agent)
    first = stored_token(agent)

    issue_node_token(node)  # rotated behind the agent's back: its token stops working
    eventually(
        lambda: AuditEvent.objects.filter(verb="node.reregister", actor=f"agent:{agent.host}").exists(),
        agent,
        "the agent did not register again",
    )
    eventually(lambda: stored_token(agent) != first, agent, "the new token was not stored")
    assert hash_token(stored_token(agent)) == NodeToken.objects.get(node=node).key_hash
    since = Node.objects.get(pk=node.pk).last_heartbeat_at
    eventually(
        lambda: Node.objects.get(pk=node.pk).last_heartbeat_at != since,
        agent,
        "heartbeats did not resume with the new token",
    )
    assert agent.running()


def test_a_second_agent_cannot_share_the_state_directory(agent: AgentProcess, tmp_path: Any) -> None:
    agent.start()
    registered(agent)
    second = AgentProcess(agent.server, agent.bootstrap, tmp_path)
    second.starts = 100  # its own log file
    second.start()
    assert second.wait(30) == 3
    assert "another agent is running" in second.log_text()
    assert agent.running()
    assert os.path.exists(agent.state_dir / "agent.lock")


def test_a_revoked_bootstrap_token_leaves_the_stored_node_token_in_use(agent: AgentProcess) -> None:
    agent.start()
    node = registered(agent)
    agent.signal()
    assert agent.wait() == 0
    BootstrapToken.objects.update(revoked_at=timezone.now())

    agent.start()
    since = Node.objects.get(pk=node.pk).last_heartbeat_at
    eventually(
        lambda: Node.objects.get(pk=node.pk).last_heartbeat_at != since,
        agent,
        "the agent did not carry on with its node token",
    )
    assert "using the stored node token" in agent.log_text()
    assert agent.running()


def test_a_refused_bootstrap_token_without_a_node_token_stops_the_agent(agent: AgentProcess) -> None:
    agent.start(DYNARL_BOOTSTRAP_TOKEN="not-a-token")
    assert agent.wait() == 3
    assert "registration refused" in agent.log_text() and "401" in agent.log_text()
    assert not Node.objects.exists()


def test_sigterm_while_the_control_plane_is_unreachable_at_start(agent: AgentProcess) -> None:
    agent.start(DYNARL_URL=f"http://127.0.0.1:{free_port()}")
    eventually(lambda: "register failed" in agent.log_text(), agent, "the agent did not try to register")
    assert agent.running()  # it keeps trying
    agent.signal()
    assert agent.wait() == 0


def test_a_node_back_from_lost_registers_again_and_reconciles(agent: AgentProcess) -> None:
    from datetime import timedelta

    from agents.services.liveness import mark_node_lost
    from cluster.models import release_devices

    agent.start()
    node = registered(agent)
    job = running_job(agent)
    names = sorted(Worker.objects.filter(group__job=job).values_list("name", flat=True))
    # The control plane gives the node up for lost and, meanwhile, one of its workers is stopped
    # without it (as a migration going on without the node would).
    now = timezone.now()
    # The liveness check skips a node whose row a heartbeat holds at that instant; it tries again.
    assert wait_until(
        lambda: mark_node_lost(node.pk, cutoff=now + timedelta(seconds=60), now=now) is not None, timeout_s=10
    )
    gone = names[0]
    Worker.objects.filter(name=gone).update(state=WorkerState.STOPPED, stopped_at=now)
    release_devices(Device.objects.filter(worker__name=gone))

    # Its next heartbeat brings the node back; the agent registers again and stops that worker.
    eventually(
        lambda: any(c["workers"] == [gone] for c in agent.calls("stop_workers")),
        agent,
        "the agent did not reconcile after its node came back",
    )
    assert "reconciled after the node came back: 1 stopped, 0 launched again" in agent.log_text()
    assert Node.objects.get(pk=node.pk).status == NodeStatus.READY
    assert AuditEvent.objects.filter(verb="node.reregister", object_id=str(node.pk)).exists()
    assert agent.running()
