"""A real job on Ray placed anew mid-way (disaggregated -> colocated), as dynarl does at an
iteration boundary: every worker stops and the new layout starts on the same devices. The trainer
does not start over: its state is kept before its ranks stop and the new ranks resume from it, so
the weight versions run on unbroken and the job succeeds. Its trainer time-shares only the GPUs its
global batch splits over."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from django.db import transaction

from cluster.models import AgentCommand
from common.audit import Actor
from common.models import AuditEvent
from jobs.models import Job, JobState
from scheduler.core.policies.base import Placement
from scheduler.core.policies.replan import PlacementChoice
from scheduler.models import PlacementChange, PlacementChangeState
from scheduler.services import placement_changes
from tests.e2e.helpers import real_job, start_ray_agents, submit, wait_released, wait_running
from tests.e2e.test_ray_job import nothing_left, wait_state
from tests.ray_cluster import LocalRayCluster
from tests.services import wait_until
from tests.stack import LiveStack

ITERATIONS = 5


@pytest.mark.django_db(transaction=True)
def test_a_real_job_placed_anew_mid_way_resumes_its_trainer_and_succeeds(
    live_stack: LiveStack, ray_cluster: LocalRayCluster, warm_start_cache: Path
) -> None:
    start_ray_agents(live_stack, ray_cluster, warm_start_cache)
    spec = real_job("replaced", iterations=ITERATIONS)
    spec["runtime"]["kl_coef"] = 0.0
    # Three devices (the reward's included): colocated, the rollout runs an engine on each and
    # the trainer, whose batch of 128 does not split over three ranks, time-shares two of them.
    spec["components"] = [
        {"name": "rollout", "kind": "rollout", "workers": 1},
        {"name": "reward", "kind": "reward", "workers": 1},
        {"name": "actor", "kind": "actor", "workers": 1, "depends_on": ["rollout", "reward"]},
    ]
    job = submit(live_stack, spec)
    wait_running(live_stack, job, timeout_s=180)

    def opened_third() -> bool:
        job.refresh_from_db()
        return job.iteration >= 2 or job.is_terminal

    assert wait_until(opened_third, timeout_s=300), live_stack.logs()
    with transaction.atomic():
        locked = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
        choice = PlacementChoice(Placement.COLOCATED, {}, 0.0, "placed anew by the test at a boundary")
        change = placement_changes.start(locked, choice, actor=Actor.scheduler())
    assert isinstance(change, PlacementChange), change
    redone = change.iteration
    assert redone >= 2
    assert len(change.layout["rollout"]) == 3 and len(change.layout["actor"]) == 2

    wait_state(live_stack, job, JobState.SUCCEEDED, timeout_s=600)
    change.refresh_from_db()
    assert change.state == PlacementChangeState.DONE, change.error
    # Every node's stop kept (or found kept) the trainer's state after the iteration before the
    # one redone, or after that one itself if the trainer had trained it by the time the stop came.
    stops = AgentCommand.objects.filter(kind="stop_workers", payload__redo_from_iteration=redone)
    outcomes = [c.result["result"]["trainer_state"][str(job.pk)] for c in stops]
    assert outcomes and all(o["kept"] and o["iteration"] in (redone - 1, redone) for o in outcomes), outcomes
    # The change's audit trail says so too, node by node.
    launching = AuditEvent.objects.get(job=job, verb="placement_change.launching")
    reports = launching.payload["stop_reports"]
    assert set(reports) == {c.node.name for c in stops}
    assert all(r["trainer_state"][str(job.pk)]["kept"] for r in reports.values()), reports

    status, results = live_stack.api("GET", f"/api/v1/jobs/{job.pk}/iterations/")
    assert status == 200, results
    assert [r["iteration"] for r in results] == list(range(ITERATIONS))
    # One optimizer step per iteration, unbroken across the re-placement: a trainer that started
    # over from the warm start would report version 1 again for the iteration redone.
    assert [r["metrics"]["weight_version"] for r in results] == [str(k + 1) for k in range(ITERATIONS)]
    assert all(r["metrics"]["samples"] == 128 for r in results)
    wait_released(live_stack, job)
    assert wait_until(lambda: nothing_left(ray_cluster, job), timeout_s=60), ray.util.list_named_actors()
    # The job is done: nothing will resume from its kept state, and it is gone.
    assert not list((warm_start_cache / f"job-{job.pk}").glob("*.pt"))
