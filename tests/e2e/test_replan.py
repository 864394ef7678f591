"""dynarl re-plans a live job at its iteration boundaries from what the job measured: an
operator's split that starves the rollout is corrected by moving trainer ranks to it."""

from __future__ import annotations

import pytest

from common.models import AuditEvent
from jobs.models import Job, JobState
from scheduler.core.decisions import Reason
from scheduler.models import Migration, MigrationState, SchedulingDecision
from tests.e2e.helpers import math_spec, start_cluster, submit, wait_running
from tests.services import wait_until
from tests.stack import LiveStack

ITERATIONS = 4


@pytest.mark.django_db(transaction=True)
def test_a_rollout_starved_by_the_spec_gets_a_larger_base_split_at_an_iteration_boundary(
    live_stack: LiveStack,
) -> None:
    start_cluster(live_stack, ("node-a", "node-b"))
    # Two rollout engines and a six-rank trainer: the rollout paces every iteration. Enough
    # prompts that an iteration spans several ticks even on the larger split the boundary picks
    # (a boundary says too little was seen of an iteration shorter than that).
    spec = math_spec(
        "replan",
        iterations=ITERATIONS,
        prompts=512,
        samples=8,
        max_new_tokens=8192,
        rollout=2,
        actor=6,
        # Kept disaggregated (as where engines and trainer cannot share a GPU's memory): what is
        # under test is the split between the groups.
        policy_params={"sustain_s": 1.0, "colocate": False},
    )
    job = submit(live_stack, spec)
    wait_running(live_stack, job)
    assert wait_until(lambda: Job.objects.get(pk=job.pk).is_terminal, timeout_s=240), live_stack.logs()
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED and job.iteration == ITERATIONS

    # Every boundary the tick saw says what the iteration measured and what follows from it.
    replans = list(AuditEvent.objects.filter(job=job, verb="replan").order_by("at"))
    assert replans, "no boundary was re-planned"
    assert all("took" in e.reason and "rollout body" in e.reason for e in replans), [
        e.reason for e in replans
    ]
    # Colocated is off for this job: every boundary says so, and nothing was time-shared.
    assert all("colocated placement is off" in e.reason for e in replans), [e.reason for e in replans]
    assert not job.groups.filter(workers__colocated_devices__isnull=False).exists()

    rebased = SchedulingDecision.objects.filter(job=job, reason=Reason.REPLAN_BASE_SPLIT.value).order_by("pk")
    assert rebased.exists(), [e.reason for e in replans]
    first = rebased.first()
    assert first is not None
    assert (first.donor, first.recipient) == ("actor", "rollout")
    assert "measured rollout body" in first.detail and "instead of 2" in first.detail
    # Like every move, it carries its prediction, for the predictor error to hold it to account.
    prediction = (first.chosen.get("chosen") or {}).get("prediction")
    assert prediction and prediction["job_after"] > prediction["job_before"]
    migration = Migration.objects.get(decision=first)
    assert migration.state == MigrationState.COMMITTED
    # It was decided at a boundary: the iteration counter had just moved on.
    boundary = AuditEvent.objects.filter(job=job, verb="job.iteration", at__lte=migration.created_at).count()
    assert boundary >= 1
