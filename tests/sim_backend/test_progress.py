"""Job progress through the control plane (``agents.services.progress``), against real PostgreSQL
and Redis, and sim agents coordinated by it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from agents.backends.base import StepFailed
from agents.backends.sim.backend import ManualClock, SimBackend
from agents.services import progress
from cluster.models import AgentCommand, CommandState, Device, DeviceStatus, Node
from common import redis as common_redis
from common.audit import Actor
from common.models import AuditEvent
from jobs.models import IterationResult, Job, Worker, WorkerState
from scheduler.models import Migration, MigrationState
from scheduler.services import gpu_migrations
from scheduler.telemetry import TelemetryError
from tests.factories import make_cluster, make_user, mark_running, spec, submit

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def clean_progress_keys(redis_reachable: None) -> Iterator[None]:
    """Job ids restart with each test database: drop the keys an earlier test left behind."""

    def drop() -> None:
        client = common_redis.shared_client()
        keys = list(client.scan_iter(match=f"{progress.KEY_PREFIX}:*", count=1000))
        if keys:
            client.delete(*keys)

    drop()
    yield
    drop()


def small_spec(**extra: Any) -> dict[str, Any]:
    data = spec(rollout=2, actor=2)
    data["workload"] = {
        "kind": "math",
        "iterations": 3,
        "prompts_per_iteration": 8,
        "samples_per_prompt": 4,
        "max_new_tokens": 512,
    }
    data.update(extra)
    return data


def place(job: Job, layout: dict[str, str]) -> None:
    """Put each worker (by group and index, "rollout-w0") on the device named (test setup)."""
    Device.objects.filter(worker__group__job=job).update(worker=None, status=DeviceStatus.FREE)
    for short, uid in layout.items():
        worker = Worker.objects.get(name=f"j{job.pk}-{short}")
        Device.objects.filter(uid=uid).update(worker=worker, status=DeviceStatus.ALLOCATED)


@pytest.fixture
def job() -> Job:
    make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4)})
    owner = make_user("alice")
    running = mark_running(submit(owner, small_spec()))
    place(
        running,
        {
            "rollout-w0": "node-a/gpu0",
            "rollout-w1": "node-b/gpu0",
            "actor-w0": "node-a/gpu1",
            "actor-w1": "node-b/gpu1",
        },
    )
    return running


def node(name: str) -> Node:
    return Node.objects.get(name=name)


def report(
    job: Job, iteration: int = 0, *, trained: int | None = None, **groups: int
) -> list[dict[str, Any]]:
    return [
        {
            "job": job.pk,
            "iteration": iteration,
            "groups": {g: {"completed": n, "assigned": n} for g, n in groups.items()},
            "trained_iteration": trained,
        }
    ]


def test_the_reply_sums_completed_samples_over_nodes_and_names_live_members(job: Job) -> None:
    progress.record(node("node-a"), report(job, rollout=10, actor=4))
    progress.record(node("node-b"), report(job, rollout=5, actor=6))
    reply = progress.reply_for(node("node-a"))
    view = reply[str(job.pk)]
    assert view["iteration"] == 0
    assert view["state"] == "running"
    assert view["groups"]["rollout"] == {
        "kind": "rollout",
        "workers": [f"j{job.pk}-rollout-w0", f"j{job.pk}-rollout-w1"],
        "completed": 15,
        "total": 32,
    }
    # Every node of the trainer reports the gang's progress: the furthest counts, not the sum.
    assert view["groups"]["actor"]["completed"] == 6
    assert "spec" not in view
    assert progress.group_progress(job.pk) == {"rollout": (15, 32), "actor": (6, 32)}


def test_the_latest_report_of_a_node_wins_and_stale_iterations_do_not_count(job: Job) -> None:
    progress.record(node("node-a"), report(job, rollout=10))
    progress.record(node("node-a"), report(job, rollout=12))
    progress.record(node("node-b"), report(job, iteration=1, rollout=30))  # not the job's iteration
    assert progress.group_progress(job.pk) == {"rollout": (12, 32)}


def test_the_first_reply_freezes_the_partition_and_claims_come_back(job: Job) -> None:
    first = progress.reply_for(node("node-a"))[str(job.pk)]["partitions"]
    members = [f"j{job.pk}-rollout-w0", f"j{job.pk}-rollout-w1"]
    assert first == {"0": {"rollout": {"workers": members, "claimed": [], "adopt": {}}}}
    # A member that leaves afterwards does not change the frozen partition.
    Worker.objects.filter(name=members[1]).update(state=WorkerState.STOPPED)
    entry = report(job, rollout=0)
    entry[0]["claims"] = {"0": {"rollout": [members[0]]}}
    progress.record(node("node-a"), entry)
    again = progress.reply_for(node("node-a"))[str(job.pk)]
    assert again["groups"]["rollout"]["workers"] == [members[0]]
    assert again["partitions"]["0"]["rollout"] == {
        "workers": members,
        "claimed": [members[0]],
        # The member gone before its agent started its share: a current member takes it over.
        "adopt": {members[1]: members[0]},
    }


def test_an_asynchronous_job_opens_the_iterations_its_staleness_allows(job: Job) -> None:
    job.spec["workload"]["staleness"] = 1
    job.save(update_fields=["spec"])
    partitions = progress.reply_for(node("node-a"))[str(job.pk)]["partitions"]
    assert sorted(partitions) == ["0", "1"]


def open_migration(job: Job, steps: list[dict[str, Any]], devices: list[str]) -> Migration:
    return Migration.objects.create(
        migration_id=f"m{job.pk}-test",
        job=job,
        strategy="workload+p2p",
        device_uids=devices,
        state=MigrationState.RUNNING,
        plan={"migration_id": f"m{job.pk}-test", "steps": steps},
    )


def test_workers_leaving_in_an_open_migration_get_no_new_work(job: Job) -> None:
    leaving = f"j{job.pk}-rollout-w1"
    open_migration(job, [{"kind": "pause_workers", "worker_ids": [leaving]}], ["node-b/gpu0"])
    view = progress.reply_for(node("node-a"))[str(job.pk)]
    assert view["groups"]["rollout"]["workers"] == [f"j{job.pk}-rollout-w0"]
    assert view["partitions"]["0"]["rollout"]["workers"] == [f"j{job.pk}-rollout-w0"]


def test_a_node_joining_the_job_through_a_migration_gets_its_spec() -> None:
    make_cluster({"node-a": ("H100", 4), "node-c": ("H100", 2)})
    running = mark_running(submit(make_user("bob"), small_spec()))
    place(
        running,
        {
            "rollout-w0": "node-a/gpu0",
            "rollout-w1": "node-a/gpu1",
            "actor-w0": "node-a/gpu2",
            "actor-w1": "node-a/gpu3",
        },
    )
    assert progress.reply_for(node("node-c")) == {}
    open_migration(running, [{"kind": "reserve_devices", "worker_ids": []}], ["node-c/gpu0"])
    view = progress.reply_for(node("node-c"))[str(running.pk)]
    assert view["spec"] == running.spec
    assert "spec" not in progress.reply_for(node("node-a"))[str(running.pk)]


def test_bad_reports_name_the_field_and_nothing_is_recorded(job: Job) -> None:
    good = report(job, rollout=3)[0]
    bad = [
        good,
        {"job": "seven", "iteration": -1, "groups": {"rollout": {"completed": 1.5}}, "trained_iteration": 0},
        {"job": job.pk, "iteration": 0, "groups": [], "trained_iteration": None},
        {"job": job.pk + 1, "iteration": 0, "groups": {}, "trained_iteration": 2},
        {
            "job": job.pk + 2,
            "iteration": 1,
            "groups": {},
            "trained_iteration": None,
            "claims": {"x": {"rollout": ["w"]}, "1": {"rollout": [7]}},
        },
    ]
    with pytest.raises(progress.ProgressError) as caught:
        progress.record(node("node-a"), bad)
    paths = {e.path for e in caught.value.errors}
    assert paths == {
        "jobs[1].job",
        "jobs[1].iteration",
        "jobs[1].groups.rollout.completed",
        "jobs[2].job",
        "jobs[2].groups",
        "jobs[3].trained_iteration",
        "jobs[4].claims.x",
        "jobs[4].claims.1.rollout[0]",
    }
    assert isinstance(caught.value, TelemetryError)  # the agent protocol answers it with a 400
    assert progress.group_progress(job.pk) == {}  # the good entry was not written either
    with pytest.raises(progress.ProgressError, match="jobs: must be a list"):
        progress.record(node("node-a"), {"job": job.pk})


def test_reports_for_jobs_that_do_not_exist_are_ignored(job: Job) -> None:
    progress.record(
        node("node-a"), [{"job": job.pk + 100, "iteration": 0, "groups": {}, "trained_iteration": 0}]
    )
    assert list(common_redis.shared_client().scan_iter(match=f"{progress.KEY_PREFIX}:*")) == []


def iteration_events(job: Job) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(verb="job.iteration", job=job).order_by("id"))


def test_the_iteration_advances_once_every_actor_node_trained_it(job: Job) -> None:
    progress.record(node("node-a"), report(job, trained=0, actor=32))
    job.refresh_from_db()
    assert job.iteration == 0  # node-b's actor rank has not finished
    progress.record(node("node-b"), report(job, trained=None, actor=20))
    job.refresh_from_db()
    assert job.iteration == 0
    progress.record(node("node-b"), report(job, trained=0, actor=32))
    job.refresh_from_db()
    assert job.iteration == 1
    [event] = iteration_events(job)
    assert event.actor == "agent:node-b"
    assert event.payload == {"from": 0, "to": 1, "nodes": ["node-a", "node-b"]}
    # Repeating the reports changes nothing.
    progress.record(node("node-b"), report(job, trained=0, actor=32))
    job.refresh_from_db()
    assert job.iteration == 1
    assert len(iteration_events(job)) == 1


def test_a_node_without_actor_workers_does_not_hold_the_job_back(job: Job) -> None:
    place(
        job,
        {
            "rollout-w0": "node-a/gpu0",
            "rollout-w1": "node-b/gpu0",
            "actor-w0": "node-a/gpu1",
            "actor-w1": "node-a/gpu2",
        },
    )
    progress.record(node("node-a"), report(job, trained=0, actor=32))
    job.refresh_from_db()
    assert job.iteration == 1


def test_the_iteration_never_moves_backwards_nor_past_the_total(job: Job) -> None:
    for k in range(3):
        for name in ("node-a", "node-b"):
            progress.record(node(name), report(job, iteration=k, trained=k))
    job.refresh_from_db()
    assert job.iteration == 3 == job.iterations_total
    for name in ("node-a", "node-b"):
        progress.record(node(name), report(job, iteration=1, trained=0))  # a stale agent
        progress.record(node(name), report(job, iteration=3, trained=3))
    job.refresh_from_db()
    assert job.iteration == 3
    assert [e.payload["to"] for e in iteration_events(job)] == [1, 2, 3]


def test_a_finished_job_does_not_advance(job: Job) -> None:
    Job.objects.filter(pk=job.pk).update(state="cancelled")
    for name in ("node-a", "node-b"):
        progress.record(node(name), report(job, trained=0))
    job.refresh_from_db()
    assert job.iteration == 0
    assert progress.advance_iteration(job.pk, Actor.system("test")) is None


@pytest.mark.django_db(transaction=True)
def test_the_shared_picture_is_kept_between_heartbeats_and_follows_every_committed_change() -> None:
    """Outside a transaction each job's database picture is kept between heartbeats and rebuilt
    when something the replies show changes: bulk updates count as much as services do."""
    make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4)})
    running = mark_running(submit(make_user("carol"), small_spec()))
    place(
        running,
        {
            "rollout-w0": "node-a/gpu0",
            "rollout-w1": "node-b/gpu0",
            "actor-w0": "node-a/gpu1",
            "actor-w1": "node-b/gpu1",
        },
    )
    members = [f"j{running.pk}-rollout-w0", f"j{running.pk}-rollout-w1"]
    first = progress.reply_for(node("node-a"))[str(running.pk)]
    kept = progress._pictures[running.pk]
    assert first["groups"]["rollout"]["workers"] == members
    # What telemetry and the tick write every second changes nothing the replies show.
    Worker.objects.filter(group__job=running).update(utilisation=0.5)
    Job.objects.filter(pk=running.pk).update(tokens_per_s=123.0, last_tick_at=timezone.now())
    progress.record(node("node-b"), report(running, rollout=7))
    again = progress.reply_for(node("node-b"))[str(running.pk)]
    assert progress._pictures[running.pk] is kept
    assert again["groups"]["rollout"]["completed"] == 7  # the nodes' reports are read fresh

    Worker.objects.filter(name=members[1]).update(state=WorkerState.STOPPED)
    assert progress.reply_for(node("node-a"))[str(running.pk)]["groups"]["rollout"]["workers"] == members[:1]
    open_migration(running, [{"kind": "pause_workers", "worker_ids": [members[0]]}], ["node-c/gpu0"])
    # The only member left is leaving: it stays listed rather than leaving the group empty.
    assert progress.reply_for(node("node-a"))[str(running.pk)]["groups"]["rollout"]["workers"] == members[:1]
    Migration.objects.filter(job=running).update(state=MigrationState.COMMITTED)
    Job.objects.filter(pk=running.pk).update(iteration=2)
    view = progress.reply_for(node("node-a"))[str(running.pk)]
    assert view["iteration"] == 2 and sorted(view["partitions"]) == ["2"]
    job_spec = dict(running.spec, workload={**running.spec["workload"], "prompts_per_iteration": 4})
    Job.objects.filter(pk=running.pk).update(spec=job_spec)
    assert progress.reply_for(node("node-a"))[str(running.pk)]["groups"]["actor"]["total"] == 16
    Job.objects.filter(pk=running.pk).update(state="cancelled")
    assert progress.reply_for(node("node-a"))[str(running.pk)]["state"] == "cancelled"


# --- sim agents coordinated through the control plane ------------------------------------------------


class Cluster:
    """Sim agents for the job's nodes, playing heartbeats and step commands against the services."""

    def __init__(self, job: Job, clock: ManualClock) -> None:
        self.job = job
        self.clock = clock
        self.backends = {
            n.name: SimBackend(n.name, gpus=4, clock=clock, speed=10.0, faults=[], sample_interval_s=0.5)
            for n in Node.objects.all()
        }
        self.launch_all()

    def launch_all(self) -> None:
        for worker in Worker.objects.filter(group__job=self.job).select_related("group"):
            for device in Device.objects.filter(worker=worker).select_related("node"):
                outcome = self.backends[device.node.name].launch_workers(
                    {"job": self.job.pk, "spec": self.job.spec},
                    [
                        {
                            "worker": worker.name,
                            "job": self.job.pk,
                            "group": worker.group.name,
                            "kind": worker.group.kind,
                            "tp": 1,
                            "pp": 1,
                            "devices": [
                                {"uid": device.uid, "index": device.index, "hardware": device.hardware}
                            ],
                        }
                    ],
                )
                assert outcome["ok"], outcome

    def heartbeat(self) -> None:
        for name, backend in self.backends.items():
            progress.record(node(name), backend.telemetry().jobs)
        for name, backend in self.backends.items():
            backend.observe_control({"jobs": progress.reply_for(node(name))})

    def play_steps(self) -> int:
        """Deliver each queued step command to its node's backend and report the outcome, until
        none is queued (each step takes its modelled time on the shared clock)."""
        played = 0
        while command := (
            AgentCommand.objects.filter(kind="migration_step", state=CommandState.QUEUED)
            .select_related("node")
            .order_by("created_at", "id")
            .first()
        ):
            command.state = CommandState.DELIVERED
            command.save(update_fields=["state"])
            payload = command.payload
            try:
                result, ok, error = self.backends[command.node.name].execute_step(payload), True, ""
            except StepFailed as exc:
                result, ok, error = {}, False, str(exc)
            gpu_migrations.report_step(
                command.node,
                payload["step"]["step_id"],
                ok=ok,
                error=error,
                result=result,
                attempt=payload["attempt"],
            )
            played += 1
        return played

    def run(self, until: Any, *, limit: int = 3000) -> None:
        for _ in range(limit):
            self.heartbeat()
            self.play_steps()
            self.job.refresh_from_db()
            if until():
                return
            self.clock.advance(0.2)
        raise AssertionError("the job did not get there")


def test_sim_agents_run_a_job_through_the_control_plane_across_a_live_migration(job: Job) -> None:
    job.spec["workload"]["max_new_tokens"] = 8192  # long responses: the migration meets a busy rollout
    job.save(update_fields=["spec"])
    cluster = Cluster(job, ManualClock())
    cluster.run(lambda: progress.group_progress(job.pk).get("rollout", (0, 1))[0] >= 1)
    # Mid-rollout, an operator moves a rollout GPU to the trainer: workload donor, p2p recipient.
    migration = gpu_migrations.request_manual_migration(
        job.pk, donor="rollout", recipient="actor", workers=1, actor=Actor.system("test operator")
    )
    cluster.run(lambda: Migration.objects.get(pk=migration.pk).state != MigrationState.RUNNING)
    migration.refresh_from_db()
    assert migration.state == MigrationState.COMMITTED, migration.error
    take_back = migration.steps.get(kind="take_back_requests")
    handed = [
        r for outcome in take_back.result["attempts"]["1"].values() for r in outcome["result"]["requests"]
    ]
    new_rank = f"actor-{migration.migration_id}-w0"
    assert Worker.objects.get(name=new_rank).state == WorkerState.RUNNING
    moved_node = Device.objects.get(uid=migration.device_uids[0]).node.name
    assert new_rank in cluster.backends[moved_node].members(job.pk, "actor")

    cluster.run(lambda: job.iteration >= job.iterations_total)
    assert [e.payload["to"] for e in iteration_events(job)] == [1, 2, 3]
    assert handed, "the paused rollout worker handed over its unfinished requests"


def test_sim_agents_shrink_the_trainer_and_grow_the_rollout_through_the_control_plane() -> None:
    make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4)})
    job = mark_running(submit(make_user("carol"), small_spec()))
    # The trainer's ranks on both nodes; the rank on node-b leaves, node-b holds no staying rank.
    place(
        job,
        {
            "rollout-w0": "node-a/gpu0",
            "rollout-w1": "node-b/gpu0",
            "actor-w0": "node-a/gpu1",
            "actor-w1": "node-b/gpu1",
        },
    )
    cluster = Cluster(job, ManualClock())
    cluster.run(lambda: job.iteration >= 1)
    migration = gpu_migrations.request_manual_migration(
        job.pk, donor="actor", recipient="rollout", workers=1, actor=Actor.system("test operator")
    )
    leaving = migration.steps.get(kind="destroy_old", group="actor").worker_names
    cluster.run(lambda: Migration.objects.get(pk=migration.pk).state != MigrationState.RUNNING)
    migration.refresh_from_db()
    assert migration.state == MigrationState.COMMITTED, migration.error
    for name in leaving:
        assert all(name not in b.running_workers() for b in cluster.backends.values())
    new_engine = f"rollout-{migration.migration_id}-w0"
    assert Worker.objects.get(name=new_engine).state == WorkerState.RUNNING
    cluster.run(lambda: job.iteration >= job.iterations_total)
    # A later iteration's partition includes the new engine, whose node claimed its share.
    partitions = [
        common_redis.shared_client().get(progress.partition_key(progress.scope_of(job), k))
        for k in range(job.iterations_total)
    ]
    assert any(p is not None and new_engine.encode() in p for p in partitions)
    assert [e.payload["to"] for e in iteration_events(job)] == [1, 2, 3]


# -- a job that really runs: iteration results and failures ----------------------------------------


def test_iteration_results_are_kept_once_each_whichever_node_reports_them(job: Job) -> None:
    first = {"iteration": 0, "mean_reward": 0.25, "accuracy": 0.25, "response_lengths": {"p50": 31}}
    second = {"iteration": 1, "mean_reward": 0.5, "accuracy": 0.5}
    progress.record(node("node-a"), [{**report(job)[0], "results": [first]}])
    progress.record(node("node-b"), [{**report(job)[0], "results": [{**first, "mean_reward": 0.9}, second]}])
    rows = list(IterationResult.objects.filter(job=job).order_by("iteration"))
    assert [(r.iteration, r.mean_reward, r.node) for r in rows] == [(0, 0.25, "node-a"), (1, 0.5, "node-b")]
    assert rows[0].metrics == first


def test_bad_results_and_failures_name_the_field(job: Job) -> None:
    entry = {
        **report(job)[0],
        "results": [{"iteration": -1, "mean_reward": float("nan")}, "x"],
        "failure": "",
    }
    with pytest.raises(progress.ProgressError) as caught:
        progress.record(node("node-a"), [entry])
    assert {e.path for e in caught.value.errors} == {
        "jobs[0].results[0].iteration",
        "jobs[0].results[0].mean_reward",
        "jobs[0].results[1]",
        "jobs[0].failure",
    }
    assert not IterationResult.objects.filter(job=job).exists()


def test_a_reported_failure_fails_the_job_with_its_reason_and_stops_its_workers(job: Job) -> None:
    why = f"worker j{job.pk}-rollout-w1 on node-b died (its Ray actor is gone)"
    progress.record(node("node-b"), [{**report(job)[0], "failure": why}])
    job.refresh_from_db()
    assert (job.state, job.state_reason, job.state_detail) == ("failed", "worker_failed", why)
    transition = job.transitions.order_by("at", "id").last()
    assert transition is not None and transition.actor == "agent:node-b"
    states = set(Worker.objects.filter(group__job=job).values_list("state", flat=True))
    assert states <= {WorkerState.STOPPING, WorkerState.STOPPED}, states
    # Repeated by every node until the workers stop: the job fails once.
    progress.record(node("node-a"), [{**report(job)[0], "failure": why}])
    assert job.transitions.filter(to_state="failed").count() == 1
