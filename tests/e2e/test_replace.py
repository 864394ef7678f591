"""dynarl places a live job anew when what the job measured says another placement is faster: a
job whose responses have no long tail is switched to time-sharing every GPU (colocated) at an
iteration boundary, by the agents, and runs to the end there."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.backends.sim.model import JobModel
from common.models import AuditEvent
from jobs.models import Job, JobState, Worker
from scheduler.core.sim.families import LengthFamily, reshape
from scheduler.core.sim.trace import generate_trace, write_trace
from scheduler.models import PlacementChange, PlacementChangeState
from tests.e2e.helpers import math_spec, submit, wait_running
from tests.services import wait_until
from tests.stack import LiveStack

ITERATIONS = 5


def what_happened(job: Job, stack: LiveStack) -> str:
    """The job's state, placement changes and audit trail, and the end of the services' logs."""
    job.refresh_from_db()
    lines = [f"job {job.pk}: {job.state} at iteration {job.iteration}"]
    lines += [
        f"change: {c.state} to {c.to_placement} at iteration {c.iteration} {c.error}"
        for c in PlacementChange.objects.filter(job=job).order_by("created_at")
    ]
    lines += [
        f"{e.at:%H:%M:%S.%f} {e.verb} {e.reason[:300]}"
        for e in AuditEvent.objects.filter(job=job).order_by("at")
    ]
    return "\n".join([*lines, stack.logs()[-8000:]])


@pytest.mark.django_db(transaction=True)
def test_a_job_without_a_tail_is_switched_to_colocated_at_a_boundary_and_finishes_there(
    live_stack: LiveStack, tmp_path: Path
) -> None:
    spec = math_spec(
        "replace",
        iterations=ITERATIONS,
        prompts=1024,
        samples=8,
        max_new_tokens=8192,
        rollout=6,
        actor=2,
        actor_valid_dp=(2, 4, 6, 8),
        policy_params={"sustain_s": 1.0},
    )
    # Response lengths drawn uniformly (no long tail): every engine drains at about the same time,
    # so time-sharing all GPUs beats keeping most of them for a rollout that is idle half the time.
    workload = JobModel(0, spec, seed=0).workload
    records = reshape(
        generate_trace(workload, 0, iterations=ITERATIONS), workload, LengthFamily.UNIFORM, seed=0
    )
    write_trace(tmp_path / "uniform.jsonl", records, workload=workload.name)
    spec["workload"]["trace"] = "uniform.jsonl"
    for host in ("node-a", "node-b"):
        live_stack.start_agent(host, gpus=4, speed=10.0, DYNARL_TRACE_DIR=str(tmp_path))
    for host in ("node-a", "node-b"):
        live_stack.agent(host).wait_registered()
    job = submit(live_stack, spec)
    wait_running(live_stack, job)
    finished = wait_until(lambda: Job.objects.get(pk=job.pk).is_terminal, timeout_s=200)
    assert finished, what_happened(job, live_stack)
    job.refresh_from_db()
    replans = [e.reason for e in AuditEvent.objects.filter(job=job, verb="replan").order_by("at")]
    assert job.state == JobState.SUCCEEDED and job.iteration == ITERATIONS, (job.state_detail, replans)

    changes = list(PlacementChange.objects.filter(job=job).order_by("created_at"))
    assert changes, replans
    first = changes[0]
    assert (first.from_placement, first.to_placement, first.state) == (
        "disaggregated",
        "colocated",
        PlacementChangeState.DONE,
    )
    assert "colocated saves" in first.detail
    # The new layout ran: every group's workers on all eight devices, time-shared, each started.
    for group in ("rollout", "actor"):
        assert len({uid for worker in first.layout[group] for uid in worker}) == 8
    new = Worker.objects.filter(name__in=first.new_workers)
    assert {w.group.name for w in new} == {"rollout", "actor"}
    assert all(w.started_at is not None for w in new)
    verbs = set(
        AuditEvent.objects.filter(job=job, verb__startswith="placement_change").values_list("verb", flat=True)
    )
    assert {"placement_change.started", "placement_change.launching", "placement_change.done"} <= verbs
