"""Colocated jobs on the live stack: groups sharing GPUs take turns on the sim agents and run to
the end, RLinf's ``actor,rollout,reward: all`` and an overlap in dynarl's format alike, and give
every device back."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.models import Device
from jobs.models import Job, JobState, Worker, WorkerState
from scheduler.models import Migration, SchedulingDecision, TelemetrySample
from tests.e2e.helpers import start_cluster, submit, wait_agents_agree, wait_released, wait_running
from tests.services import wait_until
from tests.stack import LiveStack

NODES = ("node-a", "node-b")

# RLinf's most common placement: actor, rollout and reward time-share every GPU (static-colocated).
RLINF_COLOCATED: dict[str, Any] = {
    "cluster": {
        "num_nodes": 2,
        "num_gpus_per_node": 4,
        "component_placement": {"actor,rollout,reward": "all"},
    },
    "runner": {"max_steps": 3, "experiment_name": "colocated-rlinf"},
    "algorithm": {"group_size": 2, "sampling_params": {"max_new_tokens": 512}},
    "data": {"rollout_batch_size": 16},
    "rollout": {"model": {"model_path": "/models/DeepSeek-R1-Distill-Qwen-1.5B/"}, "tensor_parallel_size": 2},
    "actor": {"model": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}},
}

# An overlap in dynarl's format: the reward model time-shares the rollout's GPUs; the trainer has
# its own, under the DynaRL policy (which may not move a time-shared GPU).
OVERLAP: dict[str, Any] = {
    "name": "colocated-overlap",
    "backend": "sim",
    "model": {"name": "qwen2.5-1.5b", "params_b": 1.5},
    "workload": {
        "kind": "math",
        "iterations": 3,
        "prompts_per_iteration": 16,
        "samples_per_prompt": 4,
        "max_new_tokens": 1024,
    },
    "components": [
        {"name": "rollout", "kind": "rollout", "placement": "0-3"},
        {
            "name": "reward",
            "kind": "reward",
            "placement": "0-3",
            "depends_on": ["rollout"],
            "colocated_with": ["rollout"],
        },
        {"name": "actor", "kind": "actor", "placement": "4-7", "depends_on": ["rollout", "reward"]},
    ],
    "policy": {"name": "dynarl", "params": {"sustain_s": 1.0}},
}


def wait_succeeded(stack: LiveStack, job: Job) -> None:
    def finished() -> bool:
        job.refresh_from_db()
        return job.is_terminal

    assert wait_until(finished, timeout_s=180), f"job {job.pk} at iteration {job.iteration}\n{stack.logs()}"
    assert job.state == JobState.SUCCEEDED, f"{job.state}: {job.state_detail}\n{stack.logs()}"
    assert job.iteration == job.iterations_total == 3


def shared_devices(job: Job) -> set[str]:
    return set(Device.objects.filter(colocated_workers__group__job=job).values_list("uid", flat=True))


@pytest.mark.django_db(transaction=True)
def test_colocated_jobs_take_turns_and_run_to_the_end(live_stack: LiveStack) -> None:
    start_cluster(live_stack, NODES)
    rlinf = submit(live_stack, RLINF_COLOCATED)
    # The overlap needs every GPU too: it waits until the RLinf job has given its devices back.
    overlap = submit(live_stack, OVERLAP)
    assert rlinf.policy == "static-colocated" and overlap.state == JobState.PENDING

    # Every worker of the three groups runs on the GPUs they all share (no launch is refused).
    wait_running(live_stack, rlinf)
    assert shared_devices(rlinf) == set(Device.objects.values_list("uid", flat=True))
    assert _workers_per_group(rlinf) == {"actor": 4, "rollout": 4, "reward": 8}
    wait_succeeded(live_stack, rlinf)
    # Each of them did its part on the shared GPUs, turn by turn.
    worked = set(TelemetrySample.objects.filter(job=rlinf, tokens__gt=0).values_list("worker", flat=True))
    assert worked == set(Worker.objects.filter(group__job=rlinf).values_list("name", flat=True))

    wait_running(live_stack, overlap, timeout_s=120)
    shared = shared_devices(overlap)
    assert shared == {f"node-a/gpu{i}" for i in range(4)}
    wait_succeeded(live_stack, overlap)
    # Whatever the policy proposed, nothing that time-shares a GPU was moved.
    for decision in SchedulingDecision.objects.filter(job=overlap):
        if shared & set(decision.device_uids):
            assert "not carried out" in decision.detail and "time-shared" in decision.detail, decision.detail
    for migration in Migration.objects.filter(job=overlap):
        assert not shared & set(migration.device_uids), migration.migration_id

    wait_released(live_stack, overlap)
    assert not Worker.objects.exclude(state=WorkerState.STOPPED).exists()
    wait_agents_agree(live_stack, NODES)


def _workers_per_group(job: Job) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in Worker.objects.filter(group__job=job).values_list("group__name", flat=True):
        counts[name] = counts.get(name, 0) + 1
    return counts
