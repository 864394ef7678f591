"""Migrations end to end through the database: plan, dispatch, reports, commit, rollback."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from cluster.models import AgentCommand, CommandState, Device, Node, NodeStatus
from common.audit import Actor
from common.models import AuditEvent
from jobs.models import Job, Worker, WorkerState
from scheduler.core.hypergraph import MigrationStrategy
from scheduler.models import (
    HypergraphSnapshot,
    Migration,
    MigrationState,
    MigrationStep,
    SchedulingDecision,
    StepState,
)
from scheduler.services import gpu_migrations
from tests.factories import make_cluster, make_user, mark_running, spec, submit
from tests.services import REPO_ROOT

pytestmark = pytest.mark.django_db


@pytest.fixture
def running_job() -> Job:
    make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4)})
    owner = make_user("alice")
    return mark_running(submit(owner, spec(rollout=6, actor=2)))


def queued_step_commands() -> list[AgentCommand]:
    return list(
        AgentCommand.objects.filter(kind="migration_step", state=CommandState.QUEUED).select_related("node")
    )


def deliver_all(*, fail_kind: str | None = None, fail_times: int = 1) -> None:
    """Play every agent: answer each queued step command until nothing is queued."""
    failures = 0
    for _ in range(200):
        commands = queued_step_commands()
        if not commands:
            return
        for command in commands:
            command.state = CommandState.DELIVERED
            command.save(update_fields=["state"])
            step = command.payload["step"]
            fail = step["kind"] == fail_kind and not command.payload["is_rollback"] and failures < fail_times
            if fail:
                failures += 1
            gpu_migrations.report_step(
                command.node,
                step["step_id"],
                ok=not fail,
                error="injected failure" if fail else "",
                attempt=command.payload["attempt"],
            )
    raise AssertionError("migration did not settle")


def group_devices(job: Job, group: str) -> set[str]:
    return set(
        Device.objects.filter(
            worker__group__job=job, worker__group__name=group, worker__state=WorkerState.RUNNING
        ).values_list("uid", flat=True)
    )


def test_manual_migration_moves_devices_only_at_commit(running_job: Job) -> None:
    operator = running_job.owner
    before_rollout = group_devices(running_job, "rollout")
    before_actor = group_devices(running_job, "actor")

    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(operator)
    )
    assert migration.state == MigrationState.RUNNING
    first = queued_step_commands()
    assert [c.payload["step"]["kind"] for c in first] == ["pause_workers"] * len(first)
    # Nothing changed owner yet.
    assert group_devices(running_job, "rollout") == before_rollout

    deliver_all()
    migration.refresh_from_db()
    assert migration.state == MigrationState.COMMITTED
    moved = set(migration.device_uids)
    assert len(moved) == 2 and moved <= before_rollout
    assert group_devices(running_job, "rollout") == before_rollout - moved
    assert group_devices(running_job, "actor") == before_actor | moved
    assert (
        Worker.objects.filter(group__job=running_job, group__name="actor", state=WorkerState.RUNNING).count()
        == 4
    )
    assert set(migration.steps.values_list("state", flat=True)) == {StepState.DONE}
    assert HypergraphSnapshot.objects.filter(job=running_job, cause="migration").exists()
    verbs = list(AuditEvent.objects.filter(job=running_job).values_list("verb", flat=True))
    assert "migration.plan" in verbs and "migration.commit" in verbs and "job.migrate" in verbs


def test_repeated_report_changes_nothing(running_job: Job) -> None:
    gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=1, actor=Actor.for_user(running_job.owner)
    )
    command = queued_step_commands()[0]
    step_id = command.payload["step"]["step_id"]
    gpu_migrations.report_step(command.node, step_id, ok=True, attempt=1)
    snapshot = (
        list(MigrationStep.objects.order_by("pk").values_list("step_id", "state", "attempts")),
        AuditEvent.objects.count(),
        AgentCommand.objects.count(),
    )
    gpu_migrations.report_step(command.node, step_id, ok=True, attempt=1)
    gpu_migrations.report_step(command.node, step_id, ok=False, error="late failure", attempt=1)
    assert (
        list(MigrationStep.objects.order_by("pk").values_list("step_id", "state", "attempts")),
        AuditEvent.objects.count(),
        AgentCommand.objects.count(),
    ) == snapshot


def test_report_for_another_node_is_refused(running_job: Job) -> None:
    gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=1, actor=Actor.for_user(running_job.owner)
    )
    command = queued_step_commands()[0]
    stranger = Node.objects.create(name="node-z")
    with pytest.raises(gpu_migrations.StepNotForNode):
        gpu_migrations.report_step(stranger, command.payload["step"]["step_id"], ok=True)
    with pytest.raises(gpu_migrations.StepNotFound):
        gpu_migrations.report_step(command.node, "no-such-step", ok=True)


@pytest.mark.parametrize(
    "failing", ["reserve_devices", "start_workers", "transfer_state", "rebuild_groups", "barrier"]
)
def test_trainer_failure_before_switch_keeps_the_old_trainer(running_job: Job, failing: str) -> None:
    before_actor = group_devices(running_job, "actor")
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    deliver_all(fail_kind=failing)
    migration.refresh_from_db()
    assert migration.state == MigrationState.ROLLED_BACK
    assert "injected failure" in migration.error
    # The trainer runs exactly on its old workers: never both, never neither.
    assert group_devices(running_job, "actor") == before_actor
    assert (
        Worker.objects.filter(group__job=running_job, group__name="actor", state=WorkerState.RUNNING).count()
        == 2
    )
    # The donor had passed its point of no return: its released devices are free, not lost.
    moved = set(migration.device_uids)
    assert not moved & group_devices(running_job, "rollout")
    assert set(Device.objects.filter(uid__in=moved).values_list("status", flat=True)) == {"free"}
    assert migration.steps.filter(is_rollback=True).exists()
    assert AuditEvent.objects.filter(verb="migration.rollback", object_id=str(migration.pk)).exists()


def test_failure_after_switch_rolls_forward(running_job: Job) -> None:
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    deliver_all(fail_kind="destroy_old", fail_times=1)
    migration.refresh_from_db()
    assert migration.state == MigrationState.COMMITTED
    destroy = migration.steps.get(kind="destroy_old", group="actor", is_rollback=False)
    assert destroy.attempts == 2 and destroy.state == StepState.DONE


def test_donor_failure_before_release_rolls_everything_back(running_job: Job) -> None:
    before = (group_devices(running_job, "rollout"), group_devices(running_job, "actor"))
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    deliver_all(fail_kind="take_back_requests")
    migration.refresh_from_db()
    assert migration.state == MigrationState.ROLLED_BACK
    assert (group_devices(running_job, "rollout"), group_devices(running_job, "actor")) == before


def test_lost_node_rolls_its_migration_back(running_job: Job) -> None:
    before_actor = group_devices(running_job, "actor")
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    # Run the donor side, then lose a node while the trainer's new workers start.
    for _ in range(50):
        commands = queued_step_commands()
        kinds = {c.payload["step"]["kind"] for c in commands}
        if "start_workers" in kinds:
            break
        for c in commands:
            gpu_migrations.report_step(
                c.node, c.payload["step"]["step_id"], ok=True, attempt=c.payload["attempt"]
            )
    target = queued_step_commands()[0].node
    Node.objects.filter(pk=target.pk).update(status=NodeStatus.LOST)
    target.refresh_from_db()
    gpu_migrations.roll_back_node(target, Actor.system("liveness"))
    deliver_all()
    migration.refresh_from_db()
    assert migration.state == MigrationState.ROLLED_BACK
    assert group_devices(running_job, "actor") == before_actor


def drive_to_the_point_of_no_return() -> AgentCommand:
    """Answer the migration's steps until its first point of no return is queued; that command."""
    for _ in range(50):
        commands = queued_step_commands()
        for command in commands:
            if command.payload["step"]["point_of_no_return"]:
                return command
        for command in commands:
            gpu_migrations.report_step(
                command.node, command.payload["step"]["step_id"], ok=True, attempt=command.payload["attempt"]
            )
    raise AssertionError("no point of no return was reached")


@pytest.mark.parametrize("outlives", [True, False])
def test_a_node_lost_at_the_point_of_no_return_is_waited_for_when_its_steps_outlive_its_agent(
    running_job: Job, outlives: bool
) -> None:
    before = (group_devices(running_job, "rollout"), group_devices(running_job, "actor"))
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    command = drive_to_the_point_of_no_return()
    node = command.node
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.LOST, steps_outlive_agent=outlives)
    node.refresh_from_db()
    gpu_migrations.roll_back_node(node, Actor.system("liveness"))
    step = MigrationStep.objects.get(migration=migration, step_id=command.payload["step"]["step_id"])
    lost = AuditEvent.objects.get(verb="migration.node_lost", object_id=str(migration.pk))
    if outlives:
        # The agent's workers may have carried the step out: it stays running, the migration
        # open, until the restarted agent reports it (or its deadline passes).
        assert step.state == StepState.RUNNING
        assert "waited for, not rolled back" in lost.reason
        Node.objects.filter(pk=node.pk).update(status=NodeStatus.READY)
        deliver_all()
        migration.refresh_from_db()
        assert migration.state == MigrationState.COMMITTED
        assert group_devices(running_job, "actor") == before[1] | set(migration.device_uids)
    else:
        # Its workers died with it: the step failed before it took effect, and the migration
        # rolled back to where it started.
        assert step.state == StepState.FAILED and lost.reason == f"node {node.name} lost"
        Node.objects.filter(pk=node.pk).update(status=NodeStatus.READY)
        deliver_all()
        migration.refresh_from_db()
        assert migration.state == MigrationState.ROLLED_BACK
        assert (group_devices(running_job, "rollout"), group_devices(running_job, "actor")) == before


def test_manual_migration_errors_name_the_field(running_job: Job) -> None:
    actor = Actor.for_user(running_job.owner)
    cases = [
        ({"donor": "nope", "recipient": "actor", "workers": 1}, "donor"),
        ({"donor": "rollout", "recipient": "nope", "workers": 1}, "recipient"),
        ({"donor": "rollout", "recipient": "rollout", "workers": 1}, "recipient"),
        ({"donor": "rollout", "recipient": "actor", "workers": 0}, "workers"),
        ({"donor": "rollout", "recipient": "actor", "workers": 99}, "workers"),
        ({"donor": "rollout", "recipient": "actor", "workers": 6}, "workers"),  # would leave no rollout
    ]
    for kwargs, field in cases:
        with pytest.raises(gpu_migrations.ManualMigrationError) as caught:
            gpu_migrations.request_manual_migration(running_job.pk, actor=actor, **kwargs)
        assert caught.value.field == field, kwargs
    assert not Migration.objects.exists()
    gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=1, actor=actor
    )
    with pytest.raises(gpu_migrations.ManualMigrationError) as caught:
        gpu_migrations.request_manual_migration(
            running_job.pk, donor="rollout", recipient="actor", workers=1, actor=actor
        )
    assert caught.value.field == "job"


def test_a_time_shared_device_is_not_moved_by_hand() -> None:
    make_cluster({"node-a": ("H100", 8)})
    owner = make_user("alice")
    colocated = json.loads((REPO_ROOT / "examples" / "math-1.5b-colocated.json").read_text())
    job = mark_running(submit(owner, colocated))
    with pytest.raises(gpu_migrations.ManualMigrationError, match="time-shared") as caught:
        gpu_migrations.request_manual_migration(
            job.pk, donor="rollout", recipient="reward", workers=1, actor=Actor.for_user(owner)
        )
    assert caught.value.field == "workers"
    assert not Migration.objects.exists() and not SchedulingDecision.objects.exists()


def test_requests_taken_back_are_handed_to_the_redistribute_step(running_job: Job) -> None:
    gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    taken = [{"request_id": "r1", "generated": 120}, {"request_id": "r2", "generated": 7}]
    for _ in range(10):
        commands = queued_step_commands()
        kinds = {c.payload["step"]["kind"] for c in commands}
        if "redistribute_requests" in kinds:
            break
        for c in commands:
            result = {"requests": taken} if c.payload["step"]["kind"] == "take_back_requests" else {}
            gpu_migrations.report_step(
                c.node, c.payload["step"]["step_id"], ok=True, result=result, attempt=1
            )
    redistribute = queued_step_commands()
    assert redistribute and all(c.payload["step"]["kind"] == "redistribute_requests" for c in redistribute)
    take_back = MigrationStep.objects.get(kind="take_back_requests")
    # Every node that took requests back contributed its list; each request goes to one staying
    # worker, named, and only that worker's node is sent it.
    assert handed_over(redistribute) == taken * len(take_back.nodes)


def handed_over(commands: list[AgentCommand]) -> list[dict[str, object]]:
    """The requests of redistribute commands, each checked to be addressed to a worker of the
    command's own node, in the order the control plane assigned them (round robin)."""
    placed = []
    for command in commands:
        step = command.payload["step"]
        devices = dict(
            zip(step["worker_ids"], _chunks(step["device_ids"], len(step["worker_ids"])), strict=True)
        )
        for request in command.payload["handover"]["requests"]:
            worker = request["to"]
            assert Device.objects.get(uid=devices[worker][0]).node_id == command.node_id
            placed.append(request)
    targets = sorted(commands[0].payload["step"]["worker_ids"])
    by_worker: dict[str, list[dict[str, object]]] = {}
    for request in placed:
        by_worker.setdefault(request["to"], []).append(request)
    ordered = []
    for position in range(len(placed)):
        ordered.append(by_worker[targets[position % len(targets)]].pop(0))
    return [{k: v for k, v in r.items() if k != "to"} for r in ordered]


def _chunks(items: list[str], parts: int) -> list[list[str]]:
    size = len(items) // parts
    return [items[k * size : (k + 1) * size] for k in range(parts)]


def test_a_growing_rollout_hands_what_its_old_engines_shed_to_the_new_ones(running_job: Job) -> None:
    """actor -> rollout: the rollout's donor side takes nothing back (the trainer holds no
    requests), its recipient side sheds queued requests after the switch; the redistribute step
    gets exactly those, not another step's."""
    gpu_migrations.request_manual_migration(
        running_job.pk, donor="actor", recipient="rollout", workers=1, actor=Actor.for_user(running_job.owner)
    )
    shed = [{"episode": 4, "iteration": 0}, {"episode": 9, "iteration": 0}]
    for _ in range(30):
        commands = queued_step_commands()
        if any(c.payload["step"]["kind"] == "redistribute_requests" for c in commands):
            break
        assert commands, "the plan stopped before redistributing"
        for c in commands:
            step = c.payload["step"]
            result = {"requests": shed} if step["kind"] == "shed_requests" else {}
            gpu_migrations.report_step(
                c.node, step["step_id"], ok=True, result=result, attempt=c.payload["attempt"]
            )
    shed_step = MigrationStep.objects.get(kind="shed_requests")
    assert shed_step.worker_names and shed_step.result
    redistribute = queued_step_commands()
    assert [c.payload["step"]["kind"] for c in redistribute] == ["redistribute_requests"] * len(redistribute)
    assert handed_over(redistribute) == shed * len(shed_step.nodes)
    new_workers = set(redistribute[0].payload["step"]["worker_ids"])
    assert new_workers.isdisjoint(shed_step.worker_names), "the new engines receive, the old ones shed"
    deliver_all()
    assert Migration.objects.get(job=running_job).state == MigrationState.COMMITTED


def deliver_until(kind: str) -> None:
    """Answer every queued step command ok until a step of ``kind`` is dispatched."""
    for _ in range(50):
        commands = queued_step_commands()
        if any(c.payload["step"]["kind"] == kind for c in commands):
            return
        assert commands, f"no {kind} step was dispatched"
        for c in commands:
            gpu_migrations.report_step(
                c.node, c.payload["step"]["step_id"], ok=True, attempt=c.payload["attempt"]
            )
    raise AssertionError(f"no {kind} step")


def test_a_node_lost_after_the_switch_is_skipped_and_the_migration_commits(running_job: Job) -> None:
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    moved = set(migration.device_uids)
    before_actor = group_devices(running_job, "actor")
    deliver_until("destroy_old")  # the actor's switch is done: its side only rolls forward
    target = queued_step_commands()[0].node
    Node.objects.filter(pk=target.pk).update(status=NodeStatus.LOST)
    target.refresh_from_db()
    gpu_migrations.roll_back_node(target, Actor.system("liveness"))
    deliver_all()
    migration.refresh_from_db()
    assert migration.state == MigrationState.COMMITTED, migration.error
    assert group_devices(running_job, "actor") == before_actor | moved
    assert not migration.steps.filter(is_rollback=True).exists()


def test_workers_an_open_migration_released_are_not_expected_on_their_node(running_job: Job) -> None:
    from agents.services.registration import expected_workers

    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    release = migration.steps.get(kind="release_devices")
    leaving = set(release.worker_names)
    assert gpu_migrations.workers_released_in_flight() == set()
    # Issued and not answered: its agent may have stopped them and died before saying so.
    deliver_until("release_devices")
    assert gpu_migrations.workers_released_in_flight() == leaving
    deliver_until("reserve_devices")  # release_devices is done; the migration is still open
    assert gpu_migrations.workers_released_in_flight() == leaving
    node = Node.objects.get(name=release.nodes[0])
    expected = {w["worker"] for w in expected_workers(node)[0]}
    assert not expected & leaving
    # Still live in the database until the migration finishes.
    assert Worker.objects.filter(name__in=leaving, state=WorkerState.RUNNING).count() == len(leaving)
    deliver_all()
    assert gpu_migrations.workers_released_in_flight() == set()


def test_new_workers_past_the_switch_are_expected_on_their_node_before_the_commit(running_job: Job) -> None:
    from agents.services.registration import expected_workers

    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    start = migration.steps.get(kind="start_workers")
    new_workers = set(start.worker_names)
    nodes = Node.objects.filter(devices__uid__in=start.device_uids).distinct()

    def expected_new() -> set[str]:
        return {w["worker"] for node in nodes for w in expected_workers(node)[0]} & new_workers

    deliver_until("switch")  # started, not switched: the agents do not run them as members yet
    assert expected_new() == set()
    deliver_until("destroy_old")  # switched: they run, though their rows come at the commit
    assert not Worker.objects.filter(name__in=new_workers).exists()
    assert expected_new() == new_workers
    shown = [w for node in nodes for w in expected_workers(node)[0] if w["worker"] in new_workers]
    assert all(w["state"] == "running" and w["group"] == "actor" and w["devices"] for w in shown)
    assert {d["uid"] for w in shown for d in w["devices"]} == set(start.device_uids)
    deliver_all()
    assert expected_new() == new_workers  # now from their rows


def test_the_policy_weighs_moves_at_what_the_jobs_migrations_took_not_the_model_alone(
    running_job: Job,
) -> None:
    assert gpu_migrations.cost_model_for(running_job).measured_scale == 1.0  # nothing measured yet
    for workers in (1, 1, 1):
        gpu_migrations.request_manual_migration(
            running_job.pk,
            donor="rollout",
            recipient="actor",
            workers=workers,
            actor=Actor.for_user(running_job.owner),
        )
        deliver_all()
    done = list(Migration.objects.filter(job=running_job, state=MigrationState.COMMITTED).order_by("pk"))
    assert len(done) == 3
    for migration, ratio in zip(done, (2.0, 6.0, 40.0), strict=True):
        migration.finished_at = migration.created_at + timedelta(seconds=migration.estimated_s * ratio)
        migration.save(update_fields=["finished_at"])
    calibrated = gpu_migrations.cost_model_for(running_job)
    assert calibrated.measured_scale == pytest.approx(6.0)  # the median: one slow outlier does not rule
    modelled = gpu_migrations.modelled_costs(running_job)
    assert modelled.measured_scale == 1.0
    p2p = {"gpus_moved": 2, "recipient_gpus_after": 4}
    assert calibrated.estimate_s(MigrationStrategy.P2P, **p2p) == pytest.approx(
        6.0 * modelled.estimate_s(MigrationStrategy.P2P, **p2p)
    )
    assert calibrated.engine_launch_s() == pytest.approx(6.0 * modelled.engine_launch_s())
    # Plans keep the modelled estimates, so the next measurement is against the same yardstick.
    nxt = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=1, actor=Actor.for_user(running_job.owner)
    )
    assert nxt.estimated_s <= done[-1].estimated_s  # not 6x: the actor only grew since


def test_a_switch_that_times_out_after_one_node_reported_settles_once_and_stays_settled(
    running_job: Job,
) -> None:
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="actor", recipient="rollout", workers=1, actor=Actor.for_user(running_job.owner)
    )
    # Answer every step until the growing rollout's switch, which runs on both nodes.
    for _ in range(50):
        commands = queued_step_commands()
        switches = [
            c
            for c in commands
            if c.payload["step"]["kind"] == "switch" and c.payload["step"]["group_id"] == "rollout"
        ]
        if switches:
            break
        for c in commands:
            gpu_migrations.report_step(
                c.node, c.payload["step"]["step_id"], ok=True, attempt=c.payload["attempt"]
            )
    assert sorted(c.node.name for c in switches) == ["node-a", "node-b"]
    # node-a answers; node-b's agent dies for good (its workers outlive it: it is waited for).
    answered, silent = sorted(switches, key=lambda c: c.node.name)
    gpu_migrations.report_step(
        answered.node, answered.payload["step"]["step_id"], ok=True, attempt=answered.payload["attempt"]
    )
    Node.objects.filter(pk=silent.node.pk).update(status=NodeStatus.LOST, steps_outlive_agent=True)
    silent.node.refresh_from_db()
    gpu_migrations.roll_back_node(silent.node, Actor.system("liveness"))
    migration.refresh_from_db()
    assert migration.state == MigrationState.RUNNING
    # Past the step's deadline, as a tick does it: the stuck step fails, then the tick advances.
    # The trainer's side had passed its point of no return and stays shrunk; the rollout's new
    # worker is destroyed (nothing to run it on node-b), and the migration is rolled back once.
    later = timezone.now() + timedelta(hours=1)
    gpu_migrations.fail_stuck_steps(migration, now=later)
    gpu_migrations.advance(migration)
    migration.refresh_from_db()
    assert migration.state == MigrationState.ROLLED_BACK
    assert migration.steps.get(kind="destroy_new").state == StepState.DONE
    gpu_migrations.advance(migration)  # a later tick finds nothing to do
    assert AuditEvent.objects.filter(verb="migration.rollback", object_id=str(migration.pk)).count() == 1


def test_engine_starts_are_priced_at_what_the_jobs_own_engines_took_to_start(running_job: Job) -> None:
    # On a deployment where an engine takes half a minute from placement to running (its process,
    # its weights, the agent's round trip), a move or a placement change that starts one costs that.
    modelled = gpu_migrations.modelled_costs(running_job)
    assert gpu_migrations.cost_model_for(running_job).engine_launch_s() == modelled.engine_launch_s()
    rollout = Worker.objects.filter(group__job=running_job, group__kind="rollout").order_by("pk")
    for worker, seconds in zip(rollout, (20.0, 30.0, 31.0, 32.0, 90.0, 30.0), strict=True):
        worker.started_at = worker.created_at + timedelta(seconds=seconds)
        worker.save(update_fields=["started_at"])
    # The trainer's ranks are not engines: a slow one does not make engine starts dearer.
    Worker.objects.filter(group__job=running_job, group__kind="actor").update(started_at=timezone.now())
    measured = gpu_migrations.cost_model_for(running_job)
    assert measured.worker_start_measured_s == pytest.approx(30.5)  # the median of the six
    assert measured.engine_launch_s() == pytest.approx(30.5)
    # Engines that start faster than the model's figure leave that figure as it is.
    rollout.update(started_at=F("created_at") + timedelta(seconds=0.5))
    assert gpu_migrations.cost_model_for(running_job).engine_launch_s() == modelled.engine_launch_s()
