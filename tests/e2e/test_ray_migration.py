"""A real job's GPUs move on the live stack, through the REST API as an operator moves them: first
a reward worker's GPU to the trainer (the reward side restarts, the trainer grows by p2p), then
two rollout engines' GPUs to the trainer in the middle of generation (the engines are paused and
what they had in flight is resumed on the remaining engine, the trainer grows by p2p again), then
two of the trainer's GPUs to the reference (the trainer shrinks by p2p, the reference grows by two
engines on the frozen warm-start weights). The Ray agents carry every step out on the real
workers, every migration commits, and the job trains on and succeeds, every iteration trained
once on its whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from common.models import AuditEvent
from jobs.models import Job, JobState
from scheduler.models import Migration, MigrationState
from tests.e2e.helpers import (
    allocation,
    live_workers,
    start_moving_real_job,
    wait_migration_finished,
    wait_released,
)
from tests.e2e.test_ray_job import nothing_left, wait_state
from tests.ray_cluster import LocalRayCluster
from tests.services import wait_until
from tests.stack import LiveStack

ITERATIONS = 32  # long enough (about a minute) for the three moves to happen while it runs


def move(stack: LiveStack, job: Job, donor: str, workers: int, recipient: str = "actor") -> Migration:
    """An operator's move of ``workers`` of ``donor``'s GPUs to ``recipient``, waited until it
    committed; the recipient then owns the moved devices besides its own."""
    before = allocation(job)
    status, body = stack.api(
        "POST",
        f"/api/v1/jobs/{job.pk}/migrate/",
        {
            "donor": donor,
            "recipient": recipient,
            "workers": workers,
            "reason": f"{recipient} is the bottleneck",
        },
    )
    assert status == 202, body
    migration = wait_migration_finished(stack, Migration.objects.get(migration_id=body["migration_id"]), 300)
    assert migration.state == MigrationState.COMMITTED, (migration.error, stack.logs())
    assert allocation(job)[recipient] == before[recipient] | set(migration.device_uids)
    return migration


@pytest.mark.django_db(transaction=True)
def test_an_operator_moves_reward_and_rollout_gpus_to_the_trainer_of_a_real_job(
    live_stack: LiveStack, ray_cluster: LocalRayCluster, warm_start_cache: Path
) -> None:
    job = start_moving_real_job(live_stack, ray_cluster, warm_start_cache, "moving", ITERATIONS, rollout=3)
    committed = [
        move(live_stack, job, "reward", workers=1),
        move(live_stack, job, "rollout", workers=2),
    ]
    assert len(live_workers(job, "actor")) == 4
    assert len(live_workers(job, "reward")) == 1 and len(live_workers(job, "rollout")) == 1
    # Then two of the trainer's GPUs to the reference: the trainer shrinks by p2p, and two new
    # reference engines start, load the frozen warm-start weights and take scoring requests.
    committed.append(move(live_stack, job, "actor", workers=2, recipient="reference"))
    assert len(live_workers(job, "actor")) == 2 and len(live_workers(job, "reference")) == 3
    reference_grown = job.iteration
    for migration in committed:
        verbs = set(
            AuditEvent.objects.filter(
                object_type=Migration._meta.label_lower, object_id=str(migration.pk)
            ).values_list("verb", flat=True)
        )
        assert {"migration.plan", "migration.commit"} <= verbs, verbs

    # Within the test's own time limit, so that a job that stalls fails with the stack's logs.
    wait_state(live_stack, job, JobState.SUCCEEDED, timeout_s=180)
    status, results = live_stack.api("GET", f"/api/v1/jobs/{job.pk}/iterations/")
    assert status == 200, results
    # Every iteration trained once, on the full batch, and pushed: one weight version per step,
    # across the migration (the new rank took the old one's step count and optimizer state).
    assert [r["iteration"] for r in results] == list(range(ITERATIONS))
    assert [r["metrics"]["weight_version"] for r in results] == [str(k + 1) for k in range(ITERATIONS)]
    assert all(r["metrics"]["samples"] == 128 for r in results)
    # The KL term to the reference was computed all along, also once the reference had grown.
    assert all(r["metrics"]["kl"] is not None for r in results)
    assert any(r["iteration"] > reference_grown for r in results)

    wait_released(live_stack, job)
    assert wait_until(lambda: nothing_left(ray_cluster, job), timeout_s=60), ray.util.list_named_actors()
