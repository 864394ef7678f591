"""dynarl moves a real job's GPUs by itself while the job learns.

The job is the real one (tiny GPT, GRPO on arithmetic, two Ray nodes) shaped the way RL
post-training usually runs: bound by its trainer. Each iteration takes ``PPO_EPOCHS`` optimizer
steps on a batch of 256 samples, so one trainer rank is busy for most of an iteration while five
rollout engines generate the batch in a fraction of it (the benchmark's run of this shape,
BENCHMARKS.md: train about 1.7 s, generate 0.5 s, an iteration 2-5 s). Nothing here tells the
policy what to do: at an iteration boundary dynarl reads what the driver measured of the
iteration, predicts the split stage by stage, and moves a rollout GPU to the trainer when a
few iterations of the saving pay for the move (a rollout engine drained and released, a new
trainer rank started and given the exact state by p2p). The test holds the job to what a user
relies on: the move is the scheduler's own, it commits, every iteration trains once on its whole
batch across it, and the reward rises as it does without moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray

from common.models import ActorType, AuditEvent
from jobs.models import JobState
from scheduler.core.decisions import Reason
from scheduler.models import Migration, MigrationState, PredictorSample
from tests.e2e.helpers import moving_real_job, start_ray_agents, submit, wait_released, wait_running
from tests.e2e.test_ray_job import nothing_left, wait_state
from tests.ray_cluster import LocalRayCluster
from tests.services import wait_until
from tests.stack import LiveStack

ITERATIONS = 12
PROMPTS = 32
PPO_EPOCHS = 8
# As the runtime's learning test measured (tests/runtime/rl/test_loop.py): the smallest rise over
# five seeds was +0.27 and the largest change without learning 0.04. This shape learns faster
# (eight steps an iteration): +0.38 in ten iterations in the benchmark's run.
MARGIN = 0.15


def trainer_bound_job(name: str) -> dict[str, Any]:
    """Five rollout engines, a reference and a reward worker, and one trainer rank that may grow
    to two or four: bench.real_job's split of eight GPUs, under dynarl."""
    spec = moving_real_job(name, ITERATIONS, rollout=5, reward=1, prompts_per_iteration=PROMPTS)
    spec["runtime"] = {"dataset_size": PROMPTS, "kl_coef": 0.02, "ppo_epochs": PPO_EPOCHS}
    spec["policy"] = {"name": "dynarl"}
    return spec


@pytest.mark.django_db(transaction=True)
def test_dynarl_moves_a_trainer_bound_real_jobs_rollout_gpu_to_its_trainer_and_the_job_learns(
    live_stack: LiveStack, ray_cluster: LocalRayCluster, warm_start_cache: Path
) -> None:
    start_ray_agents(live_stack, ray_cluster, warm_start_cache)
    job = submit(live_stack, trainer_bound_job("trainer-bound"))
    wait_running(live_stack, job, timeout_s=180)
    wait_state(live_stack, job, JobState.SUCCEEDED, timeout_s=480)

    # The scheduler's own move, made from the iteration the driver measured, and committed.
    moves = list(
        Migration.objects.filter(job=job, decision__reason=Reason.REPLAN_BASE_SPLIT.value)
        .select_related("decision")
        .order_by("created_at")
    )
    assert moves, (list(job.decisions.values_list("reason", "detail")), live_stack.logs())
    first = moves[0]
    assert first.decision is not None
    assert (first.decision.policy, first.decision.requested_by) == ("dynarl", "scheduler")
    assert (first.donor, first.recipient, first.strategy) == ("rollout", "actor", "workload+p2p")
    assert first.state == MigrationState.COMMITTED, (first.error, live_stack.logs())
    assert "measured rollout body" in first.decision.detail and "of rollout to actor" in first.decision.detail
    audit = AuditEvent.objects.filter(object_type=Migration._meta.label_lower, object_id=str(first.pk))
    assert {"migration.plan", "migration.commit"} <= set(audit.values_list("verb", flat=True))
    assert audit.filter(verb="migration.plan", actor_type=ActorType.SCHEDULER).exists()
    # Its prediction is held to account against the throughput measured after it.
    assert wait_until(lambda: PredictorSample.objects.filter(migration=first).exists(), timeout_s=30)

    status, results = live_stack.api("GET", f"/api/v1/jobs/{job.pk}/iterations/")
    assert status == 200, results
    # Every iteration trained once on its whole batch, before and after the move: PPO_EPOCHS
    # weight versions each, none lost or repeated (the new rank took the old one's state).
    assert [r["iteration"] for r in results] == list(range(ITERATIONS))
    assert [r["metrics"]["weight_version"] for r in results] == [
        str(PPO_EPOCHS * (k + 1)) for k in range(ITERATIONS)
    ]
    assert all(r["metrics"]["samples"] == PROMPTS * 8 for r in results)
    rewards = [r["mean_reward"] for r in results]
    assert sum(rewards[-5:]) / 5 >= rewards[0] + MARGIN, rewards

    wait_released(live_stack, job)
    assert wait_until(lambda: nothing_left(ray_cluster, job), timeout_s=60), ray.util.list_named_actors()
