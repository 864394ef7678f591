"""Agents killed in the middle of a real job's migrations on Ray (``crash:<step>@1`` in each
agent's fault file, armed while it runs: the agent dies once the step has taken effect and before
its outcome is recorded). The workers and the job driver are Ray actors and run on without it; the
restarted agent keeps the job's actors (a migration's new worker too), carries the interrupted step
out again (the driver ran it once and answers what it did), and the migration goes through whole,
including when the agents died in the trainer's switch, its point of no return. The job trains on
throughout, every iteration trained once on its whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from common.models import AuditEvent
from jobs.models import Job, JobState
from scheduler.models import Migration, MigrationState
from tests.e2e.helpers import (
    FINISHED_MIGRATION_STATES,
    allocation,
    live_workers,
    ownership_is_consistent,
    start_moving_real_job,
    wait_released,
)
from tests.e2e.test_ray_job import nothing_left, wait_state
from tests.ray_cluster import LocalRayCluster
from tests.services import wait_until
from tests.stack import LiveStack


@pytest.fixture
def stack_settings() -> dict[str, str]:
    # A killed Ray agent comes back as a new Ray driver, which can take half a minute on a loaded
    # two-core machine: the drills are about resuming the interrupted step, so its node is given
    # longer before it counts as lost, and its step longer before it times out (what a lost
    # node does to a step: tests/scheduler/test_gpu_migrations.py).
    return {"NODE_LOST_AFTER_S": "120", "STEP_TIMEOUT_MIN_S": "180"}


ITERATIONS = 400  # more than the drills take: the test cancels it once it trained on after them
CRASH_EXIT = 70


def drill(stack: LiveStack, job: Job, move: tuple[str, str, int, str]) -> Migration:
    """Every agent is armed (through its fault file, while it runs) to die the first time it
    carries out a step of kind ``killed``; an operator's move of ``workers`` of ``donor``'s GPUs to
    ``recipient`` runs into it. The agents that died are disarmed and started again, and the
    migration is waited for."""
    donor, recipient, workers, killed = move
    for agent in stack.agents.values():
        agent.arm(f"crash:{killed}@1")
    status, body = stack.api(
        "POST",
        f"/api/v1/jobs/{job.pk}/migrate/",
        {"donor": donor, "recipient": recipient, "workers": workers, "reason": f"drill: crash in {killed}"},
    )
    assert status == 202, body
    migration = Migration.objects.get(migration_id=body["migration_id"])
    assert migration.steps.filter(kind=killed, is_rollback=False).exists(), killed
    # Each agent dies in the first step of that kind it takes part in (a move may have several:
    # the donor's side and the recipient's, on other nodes): whichever exits is started again,
    # once, until the migration has finished.
    restarted: set[str] = set()

    def settled() -> bool:
        for name, agent in stack.agents.items():
            if name not in restarted and not agent.running():
                assert agent.returncode == CRASH_EXIT, stack.logs()
                restarted.add(name)
                agent.arm("")  # the new process carries the interrupted step out again: not to die in it
                agent.start()
        migration.refresh_from_db()
        return migration.state in FINISHED_MIGRATION_STATES

    assert wait_until(settled, timeout_s=300), (
        f"migration {migration.migration_id} still {migration.state}\n{stack.logs()}"
    )
    assert restarted, f"no agent died in {killed}"
    for name in restarted:
        stack.agents[name].wait_registered()
    return migration


def verbs(migration: Migration) -> set[str]:
    return set(
        AuditEvent.objects.filter(
            object_type=Migration._meta.label_lower, object_id=str(migration.pk)
        ).values_list("verb", flat=True)
    )


# Fifteen drills, each restarting every agent that died in it (a new Ray driver each): about
# four minutes here.
@pytest.mark.timeout(1200)
@pytest.mark.django_db(transaction=True)
def test_agents_killed_mid_migration_leave_a_real_job_whole_and_training(
    live_stack: LiveStack, ray_cluster: LocalRayCluster, warm_start_cache: Path
) -> None:
    job = start_moving_real_job(live_stack, ray_cluster, warm_start_cache, "drills", ITERATIONS, rollout=4)
    # The trainer grows by a reward GPU (its new rank's agent killed in transfer_state) and by
    # two rollout GPUs (their agents killed while taking back what the engines had in flight),
    # then shrinks back by two onto the rollout (the agents killed in the trainer's switch, the
    # point of no return, after it took effect); it grows by two rollout GPUs again (the agents
    # killed as the engines' devices are released, the workload donor's point of no return) and
    # shrinks back (the agents killed in the trainer's barrier, before its switch). Then the
    # reward's restart moves: it grows by a trainer GPU (the agents killed in its new worker's
    # health check) and gives it back (killed as its leaving worker is drained), and the
    # rollout gives two engines once more (killed as they are paused). Every move takes effect
    # whole: no rollback runs over a step that happened.
    drills = (
        ("reward", "actor", 1, "transfer_state"),
        ("rollout", "actor", 2, "take_back_requests"),
        ("actor", "rollout", 2, "switch"),
        ("rollout", "actor", 2, "release_devices"),
        ("actor", "rollout", 2, "barrier"),
        ("actor", "reward", 1, "health_check"),
        ("reward", "actor", 1, "drain"),
        ("rollout", "actor", 2, "pause_workers"),
        # The donor steps left: the trainer shrinking (killed as its group is rebuilt, before the
        # switch; as its leaving ranks are destroyed, after it; as their devices are released),
        # the rollout's taken-back requests handed to its staying engines, and the reward giving
        # a worker up (killed as it stops, and as its device is released).
        ("actor", "rollout", 2, "rebuild_groups"),
        ("rollout", "actor", 2, "redistribute_requests"),
        ("actor", "rollout", 2, "destroy_old"),
        ("actor", "reward", 1, "switch"),
        ("reward", "actor", 1, "stop_workers"),
        ("actor", "reward", 1, "release_devices"),
        ("reward", "actor", 1, "release_devices"),
    )
    for move in drills:
        donor, recipient, _, killed = move
        before = allocation(job)
        moved = drill(live_stack, job, move)
        assert moved.state == MigrationState.COMMITTED, (killed, moved.error, live_stack.logs())
        assert {"migration.plan", "migration.commit"} <= verbs(moved)
        assert "migration.rollback" not in verbs(moved)
        after = allocation(job)
        assert after[recipient] == before[recipient] | set(moved.device_uids), killed
        assert not after[donor] & set(moved.device_uids), killed
        assert ownership_is_consistent(job) == [], killed
    assert len(live_workers(job, "actor")) == 2, live_workers(job)
    assert len(live_workers(job, "rollout")) == 4 and len(live_workers(job, "reward")) == 1

    # It trains on at the layout the drills left, then the operator cancels it.
    trained = job.iteration_results.count()
    assert wait_until(lambda: job.iteration_results.count() >= trained + 3, timeout_s=120), live_stack.logs()
    status, body = live_stack.api("POST", f"/api/v1/jobs/{job.pk}/cancel/", {"reason": "drills done"})
    assert status == 200, body
    wait_state(live_stack, job, JobState.CANCELLED, timeout_s=120)
    status, results = live_stack.api("GET", f"/api/v1/jobs/{job.pk}/iterations/")
    assert status == 200, results
    # Every iteration trained once, on the full batch, and pushed: one weight version per step.
    assert [r["iteration"] for r in results] == list(range(len(results)))
    assert [r["metrics"]["weight_version"] for r in results] == [str(k + 1) for k in range(len(results))]
    assert all(r["metrics"]["samples"] == 128 for r in results)
    wait_released(live_stack, job)
    assert wait_until(lambda: nothing_left(ray_cluster, job), timeout_s=60), ray.util.list_named_actors()
