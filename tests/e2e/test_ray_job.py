"""A real RL job on the live stack: submitted through the REST API, placed by the control plane on
two Ray nodes, run by their agents (``--backend ray``) as real engines, a real trainer and a reward
worker, learning, and succeeding; a job whose worker dies fails with a reason an operator reads.
Nothing is left on the Ray cluster afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from agents.backends.ray import driver_client
from agents.backends.ray.actors import actor_name
from agents.backends.ray.connection import connect
from common.models import AuditEvent
from jobs.models import Job, JobState, Worker
from scheduler.models import PlacementChange, PlacementChangeState
from tests.e2e.helpers import (
    REAL_JOB_ITERATIONS,
    real_job,
    start_ray_agents,
    submit,
    wait_released,
    wait_running,
)
from tests.ray_cluster import NAMESPACE, LocalRayCluster
from tests.services import wait_until
from tests.stack import LiveStack


def wait_state(stack: LiveStack, job: Job, state: str, timeout_s: float) -> None:
    def reached() -> bool:
        job.refresh_from_db()
        return job.state == state or job.is_terminal

    assert wait_until(reached, timeout_s=timeout_s), f"job {job.pk} is {job.state}\n{stack.logs()}"
    assert job.state == state, f"job {job.pk} ended {job.state}: {job.state_detail}\n{stack.logs()}"


def nothing_left(cluster: LocalRayCluster, job: Job) -> bool:
    connect(cluster.address, namespace=NAMESPACE)
    return not driver_client.job_actors(job.pk) and driver_client.driver_handle(job.pk) is None


@pytest.mark.django_db(transaction=True)
def test_a_real_job_learns_and_succeeds(
    live_stack: LiveStack, ray_cluster: LocalRayCluster, warm_start_cache: Path
) -> None:
    start_ray_agents(live_stack, ray_cluster, warm_start_cache)
    job = submit(live_stack, real_job("real-math"))
    wait_running(live_stack, job, timeout_s=180)
    wait_state(live_stack, job, JobState.SUCCEEDED, timeout_s=600)
    assert job.iteration == REAL_JOB_ITERATIONS

    status, results = live_stack.api("GET", f"/api/v1/jobs/{job.pk}/iterations/")
    assert status == 200, results
    assert [r["iteration"] for r in results] == list(range(REAL_JOB_ITERATIONS))
    # Each iteration ended with every rollout engine on the trainer's new weights (checked by the
    # driver before the iteration's result exists), one version per optimizer step.
    assert [r["metrics"]["weight_version"] for r in results] == [
        str(k + 1) for k in range(REAL_JOB_ITERATIONS)
    ]
    assert all(r["metrics"]["samples"] == 128 for r in results)
    # It learns: the mean reward of its last five iterations is above its first's by a margin that
    # the runtime's learning test shows safe (see real_job).
    rewards = [r["mean_reward"] for r in results]
    assert sum(rewards[-5:]) / 5 >= rewards[0] + 0.15, rewards

    # Its signals are measured: the trainer's ranks waited for data while the rollout ran (the
    # share of each bucket they sat idle), and the devices' readings say what measured them.
    status, history = live_stack.api("GET", f"/api/v1/jobs/{job.pk}/telemetry/")
    assert status == 200, history
    series = {g["kind"]: g["points"] for g in history["groups"]}
    trainer_waits = [p["waiting_mean"] for p in series["actor"] if p["waiting_mean"] is not None]
    assert trainer_waits and max(trainer_waits) > 0.0, series["actor"]
    assert all(p["waiting_mean"] is None for p in series["rollout"])  # engines do not wait: they queue
    status, devices = live_stack.api("GET", "/api/v1/devices/?page_size=100")
    assert status == 200, devices
    sources = {
        d["reading_source"]
        for d in devices["results"]
        if d["node"] in ray_cluster.nodes and d["reported_at"] is not None
    }
    assert sources == {"process_cpu"}, sources  # no NVML here: the CPU share, labelled as such

    wait_released(live_stack, job)
    assert wait_until(lambda: nothing_left(ray_cluster, job), timeout_s=60), ray.util.list_named_actors()


@pytest.mark.django_db(transaction=True)
def test_an_agentic_job_calls_its_tool_workers_turn_by_turn_and_succeeds(
    live_stack: LiveStack, ray_cluster: LocalRayCluster, warm_start_cache: Path
) -> None:
    """The agentic variant under dynarl: episodes of up to three turns, each calculator call
    answered by the job's tool worker, turns dispatched by the DataRouter to the engine holding
    the episode's KV prefix; what each iteration did is in its result. Whatever dynarl decides
    at a boundary (a re-placement included), the trainer keeps a size its batch splits over."""
    start_ray_agents(live_stack, ray_cluster, warm_start_cache)
    spec = real_job(
        "real-agentic", kind="agentic", iterations=6, max_turns=3, tool_latency_s=0.01, max_new_tokens=44
    )
    spec["components"].insert(2, {"name": "tools", "kind": "tool", "workers": 1})
    spec["policy"] = {"name": "dynarl"}
    job = submit(live_stack, spec)
    wait_running(live_stack, job, timeout_s=180)
    wait_state(live_stack, job, JobState.SUCCEEDED, timeout_s=600)

    status, results = live_stack.api("GET", f"/api/v1/jobs/{job.pk}/iterations/")
    assert status == 200, results
    assert [r["iteration"] for r in results] == list(range(6))
    for result in results:
        metrics = result["metrics"]
        agentic = metrics["agentic"]
        assert agentic["tool_calls"] > 0, metrics
        follow_ups = agentic["tool_calls"] - agentic["tool_errors"]
        assert agentic["turns"] == metrics["samples"] + follow_ups
        # Priority routing: a follow-up turn goes to the engine that served the episode's last
        # one (or, kept waiting, another); that engine's cache gave most of its context back.
        assert agentic["affinity_hits"] + agentic["affinity_steals"] == follow_ups
        assert agentic["cached_tokens"] > agentic["reprefilled_tokens"]
        assert metrics["tokens_trained"] < metrics["tokens_generated"]  # tool answers are not trained
    # One optimizer step per iteration, unbroken whatever dynarl did at the boundaries (a
    # re-placement included: the trainer resumes from its kept state).
    assert [r["metrics"]["weight_version"] for r in results] == [str(k + 1) for k in range(6)]
    # dynarl's reasoning at each boundary is in the audit trail: what the iteration measured (the
    # driver's report of its phases; these iterations are too short for the ticks' signals) and
    # the placement that follows, or, where a boundary's tick came before the iteration's result
    # was recorded, that it saw too little; any placement change it made went through. Iterations
    # take about a second here: on a loaded machine a tick may see two boundaries at once, or
    # first look at the job after its first iteration (that look learns from the driver's report).
    replans = list(AuditEvent.objects.filter(job=job, verb="replan").values_list("reason", flat=True))
    assert any("rollout body" in r for r in replans), replans
    assert all("rollout body" in r or "too little of it seen" in r for r in replans), replans
    changes = PlacementChange.objects.filter(job=job)
    assert all(c.state == PlacementChangeState.DONE for c in changes), [(c.state, c.error) for c in changes]
    # Real tool workers, started by their nodes' agents (new ones after a re-placement).
    tools = Worker.objects.filter(group__job=job, group__name="tools")
    assert tools.exists() and all(w.started_at is not None for w in tools)
    wait_released(live_stack, job)
    assert wait_until(lambda: nothing_left(ray_cluster, job), timeout_s=60), ray.util.list_named_actors()


@pytest.mark.django_db(transaction=True)
def test_a_job_whose_engine_dies_fails_with_a_readable_reason(
    live_stack: LiveStack, ray_cluster: LocalRayCluster, warm_start_cache: Path
) -> None:
    start_ray_agents(live_stack, ray_cluster, warm_start_cache)
    job = submit(live_stack, real_job("doomed", iterations=50))
    wait_running(live_stack, job, timeout_s=180)
    assert wait_until(lambda: job.iteration_results.exists(), timeout_s=300), live_stack.logs()
    engine = Worker.objects.get(group__job=job, name=f"j{job.pk}-rollout-w1")
    node = engine.devices.get().node.name
    connect(ray_cluster.address, namespace=NAMESPACE)
    ray.kill(ray.get_actor(actor_name(node, engine.name)), no_restart=True)

    wait_state(live_stack, job, JobState.FAILED, timeout_s=120)
    assert job.state_reason == "worker_failed"
    assert engine.name in job.state_detail, job.state_detail
    wait_released(live_stack, job)
    assert wait_until(lambda: nothing_left(ray_cluster, job), timeout_s=60), ray.util.list_named_actors()
