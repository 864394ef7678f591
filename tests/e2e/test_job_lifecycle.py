"""A job's whole life on the live stack: submitted through the REST API, admitted, launched by the
agents, telemetry flowing, the tick moving GPUs with a migration the agents carry out step by
step, a predictor sample once it settles, and the iterations run to the end with every device
given back."""

from __future__ import annotations

import itertools
import time
from datetime import timedelta

import pytest

from cluster.models import AgentCommand, CommandState
from common.models import AuditEvent
from jobs.models import JobState
from scheduler import telemetry
from scheduler.models import (
    HypergraphSnapshot,
    Migration,
    MigrationState,
    PredictorSample,
    StepState,
    Tick,
)
from tests.e2e.helpers import (
    allocation,
    live_workers,
    math_spec,
    start_cluster,
    submit,
    wait_agents_agree,
    wait_migration_finished,
    wait_released,
    wait_running,
)
from tests.services import wait_until
from tests.stack import DEFAULT_SIM_SPEED, LiveStack

NODES = ("node-a", "node-b")


@pytest.mark.django_db(transaction=True)
def test_a_submitted_job_is_launched_and_the_tick_moves_its_gpus(live_stack: LiveStack) -> None:
    # A quarter of the usual sim speed: the trainer's part of an iteration (when the rollout
    # engines sit idle) then lasts many times the ~1 s the cost model gives a move, so lending the
    # idle engines to the trainer clearly pays. At full speed it lasts ~3 s and the gain is
    # within the move's cost: the policy rightly hesitates, and the test with it.
    start_cluster(live_stack, NODES, speed=DEFAULT_SIM_SPEED / 4)
    # Long rollout tails (8k tokens, 2048 episodes) so idle engines are plain to see; a short
    # sustain so the policy acts within the first iterations; more iterations than the test waits.
    spec = math_spec(
        "lifecycle", prompts=256, samples=8, max_new_tokens=8192, policy_params={"sustain_s": 1.0}
    )
    job = submit(live_stack, spec)
    assert job.state in (JobState.ADMITTED, JobState.RUNNING)

    # Admitted and launched: every worker runs on an agent, on the devices the database gave it.
    wait_running(live_stack, job)
    before = allocation(job)
    assert {g: len(d) for g, d in before.items()} == {"rollout": 6, "actor": 2}
    wait_agents_agree(live_stack, NODES)

    # Telemetry flows: every live worker has samples in the live window, and the tick runs.
    def every_worker_reports() -> bool:
        reported = {s.worker_id for s in telemetry.recent_samples(job.pk, time.time() - 10)}
        return live_workers(job) <= reported

    assert wait_until(every_worker_reports, timeout_s=60), live_stack.logs()
    assert wait_until(lambda: Tick.objects.filter(job=job).exists(), timeout_s=30), live_stack.logs()

    # The tick decides, and its migration is carried out by the agents, step by step.
    def decided() -> bool:
        return Migration.objects.filter(job=job, decision__policy="dynarl").exists()

    assert wait_until(decided, timeout_s=150), (
        f"no decision; ticks: {list(Tick.objects.filter(job=job).values_list('outcome', 'note')[:10])}"
        f"\n{live_stack.logs()}"
    )
    migration = Migration.objects.filter(job=job, decision__policy="dynarl").order_by("created_at").first()
    assert migration is not None
    decision = migration.decision
    assert decision is not None and decision.policy == "dynarl" and decision.tick_id is not None
    # No further moves from here on (the policy may soon hand the GPUs back): what follows is
    # about this one. A paused job still drives its migration and settles its predictions.
    status, body = live_stack.api("POST", f"/api/v1/jobs/{job.pk}/pause/", {"detail": "inspecting"})
    assert status == 200, body
    assert Migration.objects.filter(job=job).count() == 1
    migration = wait_migration_finished(live_stack, migration)
    assert migration.state == MigrationState.COMMITTED, migration.error
    steps = list(migration.steps.order_by("index"))
    assert steps and all(s.state == StepState.DONE and not s.is_rollback for s in steps)
    for step in steps:
        outcomes = step.result["attempts"][str(step.attempts)]
        assert set(outcomes) == set(step.nodes) and all(o["ok"] for o in outcomes.values()), step.result
        commands = AgentCommand.objects.filter(step=step)
        assert {c.node.name for c in commands} == set(step.nodes)
        assert all(
            c.state == CommandState.DONE for c in commands if c.command_id.endswith(f"#{step.attempts}")
        )
    # One after the other: each step started once the one before it had finished.
    for earlier, later in itertools.pairwise(steps):
        assert earlier.finished_at is not None and later.started_at is not None
        assert later.started_at >= earlier.finished_at

    # The allocation changed in the database as decided ...
    moved = set(migration.device_uids)
    after = allocation(job)
    donor, recipient = migration.donor, migration.recipient
    assert after[recipient] == before[recipient] | moved
    assert after[donor] == before[donor] - moved
    # ... in the snapshot taken when it committed ...
    snapshot = (
        HypergraphSnapshot.objects.filter(job=job, taken_at__gte=migration.finished_at)
        .order_by("taken_at")
        .first()
    )
    assert snapshot is not None
    in_snapshot = {
        n["id"]: {d["id"] for w in n["workers"] for d in w["devices"]} for n in snapshot.data["nodes"]
    }
    assert in_snapshot[recipient] == after[recipient] and in_snapshot[donor] == after[donor]
    # ... and on the agents.
    wait_agents_agree(live_stack, NODES)

    # Once it settles, the predictor's forecast is compared with what happened.
    assert wait_until(lambda: PredictorSample.objects.filter(migration=migration).exists(), timeout_s=60), (
        live_stack.logs()
    )
    sample = PredictorSample.objects.filter(migration=migration).order_by("recorded_at").first()
    assert sample is not None
    settle = float(live_stack.env["PREDICTOR_SETTLE_S"])
    assert migration.finished_at is not None
    assert sample.recorded_at >= migration.finished_at + timedelta(seconds=settle)


@pytest.mark.django_db(transaction=True)
def test_a_job_runs_its_iterations_to_the_end_and_gives_its_devices_back(live_stack: LiveStack) -> None:
    start_cluster(live_stack, NODES)
    job = submit(live_stack, math_spec("to-the-end", iterations=4))
    wait_running(live_stack, job)
    wait_agents_agree(live_stack, NODES)

    def finished() -> bool:
        job.refresh_from_db()
        return job.is_terminal

    assert wait_until(finished, timeout_s=120), f"job at iteration {job.iteration}\n{live_stack.logs()}"
    assert job.state == JobState.SUCCEEDED
    assert job.iteration == job.iterations_total == 4
    # Every iteration was advanced by the agents' reports, one at a time.
    advances = AuditEvent.objects.filter(job=job, verb="job.iteration").order_by("at", "id")
    assert [(e.payload["from"], e.payload["to"]) for e in advances] == [(k, k + 1) for k in range(4)]

    # Every worker stops (the agents confirm), every device is free, and the agents run nothing.
    wait_released(live_stack, job)
    wait_agents_agree(live_stack, NODES)
