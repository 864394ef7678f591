"""The same job spec under ``static-disaggregated`` and under ``dynarl``, side by side on the live
stack (8 GPUs each, all 16 taken, so neither can grow): how long their iterations take. The ratio is reported, not
asserted: wall-clock time on a shared test machine proves nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.models import AuditEvent
from jobs.models import Job, JobState
from scheduler.models import Migration, MigrationState
from tests.e2e.helpers import math_spec, start_cluster, submit, wait_running
from tests.services import wait_until
from tests.stack import LiveStack

ITERATIONS = 6
POLICIES = ("static-disaggregated", "dynarl")


def iteration_seconds(job: Job) -> float:
    """Mean wall seconds per iteration, from the job's start to its last iteration's end."""
    started = job.transitions.filter(to_state=JobState.RUNNING).order_by("at").first()
    advances = AuditEvent.objects.filter(job=job, verb="job.iteration").order_by("at")
    last = advances.last()
    assert started is not None and last is not None
    assert advances.count() == ITERATIONS
    return (last.at - started.at).total_seconds() / ITERATIONS


@pytest.mark.django_db(transaction=True)
def test_the_same_spec_under_static_and_dynarl_policies(live_stack: LiveStack, tmp_path: Path) -> None:
    start_cluster(live_stack, ("node-a", "node-b", "node-c", "node-d"))
    jobs = {}
    for policy in POLICIES:
        spec = math_spec(
            f"compare-{policy}",
            policy=policy,
            iterations=ITERATIONS,
            prompts=256,
            samples=8,
            max_new_tokens=8192,
            policy_params={"sustain_s": 1.0} if policy == "dynarl" else {},
        )
        jobs[policy] = submit(live_stack, spec)
    for job in jobs.values():
        wait_running(live_stack, job)
    hosts = {
        policy: sorted(set(job.groups.values_list("workers__devices__node__name", flat=True)) - {None})
        for policy, job in jobs.items()
    }

    def both_finished() -> bool:
        return all(Job.objects.get(pk=job.pk).is_terminal for job in jobs.values())

    assert wait_until(both_finished, timeout_s=240), live_stack.logs()
    for job in jobs.values():
        job.refresh_from_db()
        assert job.state == JobState.SUCCEEDED and job.iteration == ITERATIONS
    seconds = {policy: iteration_seconds(job) for policy, job in jobs.items()}
    moves = {
        policy: Migration.objects.filter(job=job, state=MigrationState.COMMITTED).count()
        for policy, job in jobs.items()
    }
    assert moves["static-disaggregated"] == 0
    report = {
        "iterations": ITERATIONS,
        "seconds_per_iteration": seconds,
        "committed_migrations": moves,
        "hosts": hosts,
        "dynarl_over_static": seconds["dynarl"] / seconds["static-disaggregated"],
    }
    (tmp_path / "policy-comparison.json").write_text(json.dumps(report, indent=2))
    print(f"\npolicy comparison ({ITERATIONS} iterations, wall seconds per iteration):")
    for policy in POLICIES:
        print(f"  {policy:22s} {seconds[policy]:7.2f} s   {moves[policy]} migrations committed")
    print(
        f"  dynarl / static ratio: {report['dynarl_over_static']:.3f}  ({tmp_path / 'policy-comparison.json'})"
    )
