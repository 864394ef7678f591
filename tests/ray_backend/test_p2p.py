"""The trainer's p2p migrations on Ray: the agents carry out the steps the control plane plans
(scheduler/core/migration.py) on a real job on the two-node loopback cluster. Growing onto
another node moves the exact state and the job trains on at the new size; shrinking off the rank
that pushes the weights hands the push to the staying rank; a new rank dying before the transfer
rolls back to the old layout, which goes on as if nothing happened, and so does one killed in the
middle of the transfer."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import ray

from agents.backends.base import StepFailed
from agents.backends.ray import driver as job_driver
from agents.backends.ray import driver_client
from agents.backends.ray.backend import RayBackend
from runtime.rl import state_transfer
from tests.ray_backend.test_backend import entry_until, tiny_spec, worker

OLD = "actor-w0"


def layout(job: int) -> dict[str, list[dict[str, Any]]]:
    """One trainer rank on node-a to start with; node-b has a free device (gpu1) to grow onto."""
    return {
        "node-a": [
            worker(job, "rollout", 0, "rollout", 0),
            worker(job, "actor", 0, "actor", 1),
            worker(job, "reward", 0, "reward", 2),
        ],
        "node-b": [worker(job, "rollout", 1, "rollout", 0)],
    }


def picture(job: int, iteration: int, actors: list[str]) -> dict[str, Any]:
    groups: dict[str, dict[str, Any]] = {"actor": {"kind": "actor", "workers": actors}}
    for workers in layout(job).values():
        for w in workers:
            if w["kind"] != "actor":
                groups.setdefault(w["group"], {"kind": w["kind"], "workers": []})["workers"].append(
                    w["worker"]
                )
    return {"jobs": {str(job): {"iteration": iteration, "state": "running", "groups": groups}}}


def step(
    job: int,
    migration: str,
    index: int,
    kind: str,
    workers: list[str],
    devices: list[str],
    *,
    group: str = "actor",
    strategy: str = "p2p",
    share: float = 0.0,
) -> dict[str, Any]:
    """A migration_step command's payload, as the control plane sends it (the trainer's p2p steps
    unless told otherwise; ``share`` for a growing group's shed_requests)."""
    return {
        "migration": migration,
        "job": job,
        "attempt": 1,
        "is_rollback": False,
        "step": {
            "step_id": f"{migration}:{index:02d}:{kind}",
            "index": index,
            "kind": kind,
            "group_id": group,
            "strategy": strategy,
            "device_ids": devices,
            "worker_ids": workers,
            "share": share,
        },
    }


def launch(agents: dict[str, RayBackend], job: int) -> None:
    spec = tiny_spec(f"job-{job}", actors=1)
    for node, workers in layout(job).items():
        outcome = agents[node].launch_workers({"job": job, "spec": spec}, workers)
        assert outcome["ok"], outcome


def run_steps(agents: dict[str, RayBackend], payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step on every node, in order (a node with no part in a step does nothing)."""
    return [agents[node].execute_step(payload) for payload in payloads for node in sorted(agents)]


def train(agents: dict[str, RayBackend], job: int, iteration: int, actors: list[str]) -> dict[str, Any]:
    for backend in agents.values():
        backend.observe_control(picture(job, iteration, actors))
    entry = entry_until(
        agents["node-a"], job, lambda e: e.get("trained_iteration") == iteration or "failure" in e
    )
    assert "failure" not in entry, entry
    return entry


def rank(name: str) -> Any:
    return job_driver.worker_actor(name)


def test_growing_onto_another_node_and_shrinking_off_the_pushing_rank(agents: dict[str, RayBackend]) -> None:
    job = 41
    old = f"j{job}-{OLD}"
    launch(agents, job)
    train(agents, job, 0, [old])

    # Grow: the recipient side of a p2p migration, as planned for one device of node-b.
    migration, new, device = f"m{job}-1", f"actor-m{job}-1-w0", "node-b/gpu1"
    grown = [old, new]
    run_steps(
        agents,
        [
            step(job, migration, 0, "reserve_devices", [], [device]),
            step(job, migration, 1, "start_workers", [new], [device]),
            step(job, migration, 2, "transfer_state", [new], [device]),
            step(job, migration, 3, "rebuild_groups", grown, ["node-a/gpu1", device]),
            step(job, migration, 4, "barrier", grown, ["node-a/gpu1", device]),
            step(job, migration, 5, "switch", grown, ["node-a/gpu1", device]),
            step(job, migration, 6, "destroy_old", [], []),
        ],
    )
    # The new rank holds exactly the old one's parameters and AdamW state, in the new group.
    assert ray.get(rank(new).checksums.remote()) == ray.get(rank(old).checksums.remote())
    assert ray.get(rank(new).generation.remote()) == f"dp-{migration}-a1"
    entry = train(agents, job, 1, grown)
    # Two ranks, one step: the global batch split over them, and they end identical.
    assert ray.get(rank(new).checksums.remote()) == ray.get(rank(old).checksums.remote())
    assert entry["results"][-1]["weight_version"] == "2"
    on_b = {e["job"]: e for e in agents["node-b"].telemetry().jobs}[job]
    assert on_b["groups"]["actor"]["completed"] == on_b["groups"]["actor"]["assigned"] == 8  # node-b trained

    # Shrink off the old rank 0 (the one pushing weights): the donor side of a p2p migration.
    migration = f"m{job}-2"
    run_steps(
        agents,
        [
            step(job, migration, 0, "transfer_state", [old], ["node-a/gpu1"]),
            step(job, migration, 1, "rebuild_groups", [new], [device]),
            step(job, migration, 2, "barrier", [new], [device]),
            step(job, migration, 3, "switch", [new], [device]),
            step(job, migration, 4, "destroy_old", [old], ["node-a/gpu1"]),
            step(job, migration, 5, "release_devices", [old], ["node-a/gpu1"]),
        ],
    )
    assert driver_client.job_actors(job).count(f"node-a/{old}") == 0
    entry = train(agents, job, 2, [new])
    # The staying rank pushed the weights: every engine reports its step.
    assert entry["results"][-1]["weight_version"] == "3"
    assert entry["results"][-1]["samples"] == 8


def die_once_the_first_tensor_arrived(rank_actor: Any) -> None:
    """Run in a new rank's own process (``__ray_call__``): the receive loop checks each tensor of
    the state as it lands, so the first check SIGKILLs the process, with the first tensor in and
    the rest of the transfer (the other tensors, the sender's checksums, the verdict) to come."""

    def killed(tensor: Any) -> int:
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    state_transfer._checksum = killed


def grow_and_lose_the_new_rank(agents: dict[str, RayBackend], job: int, kill: str) -> None:
    """Grow the trainer of a job that trained iteration 0 by one rank on node-b, lose the new
    rank (``kill``: "before" the transfer step, or "mid" transfer), see the transfer step fail,
    roll back, and train on with the old rank alone, its state as it was."""
    old = f"j{job}-{OLD}"
    launch(agents, job)
    train(agents, job, 0, [old])
    before = ray.get(rank(old).checksums.remote())

    migration, new, device = f"m{job}-1", f"actor-m{job}-1-w0", "node-b/gpu1"
    run_steps(
        agents,
        [
            step(job, migration, 0, "reserve_devices", [], [device]),
            step(job, migration, 1, "start_workers", [new], [device]),
        ],
    )
    if kill == "before":
        ray.kill(rank(new), no_restart=True)
    else:
        ray.get(rank(new).__ray_call__.remote(die_once_the_first_tensor_arrived))
    with pytest.raises(StepFailed, match="transfer_state") as failed:
        agents["node-b"].execute_step(step(job, migration, 2, "transfer_state", [new], [device]))
    if kill == "mid":  # the transfer had begun: it is what failed, not a missing rank
        assert "the state transfer failed: actor-" in str(failed.value), failed.value
    # The rollback: the compensations of the steps that ran, newest first.
    run_steps(
        agents,
        [
            step(job, migration, 2, "discard_transfer", [new], [device]),
            step(job, migration, 1, "destroy_new", [new], [device]),
            step(job, migration, 0, "release_reservation", [], [device]),
        ],
    )
    # The old rank never left its group nor changed its state; the job trains on with it.
    assert ray.get(rank(old).generation.remote()) == "dp-0"
    assert ray.get(rank(old).checksums.remote()) == before
    entry = train(agents, job, 1, [old])
    assert entry["results"][-1]["weight_version"] == "2"
    assert not [n for n in driver_client.job_actors(job) if n.endswith(new)]


def test_a_new_rank_dying_before_the_transfer_rolls_back_and_the_old_layout_trains_on(
    agents: dict[str, RayBackend],
) -> None:
    grow_and_lose_the_new_rank(agents, 42, kill="before")


def test_a_new_rank_killed_mid_transfer_rolls_back_and_the_old_layout_trains_on(
    agents: dict[str, RayBackend],
) -> None:
    # The sender, a rank of the running trainer, is in the middle of the transfer when its peer
    # dies: it must give up at once (the backend abandons the transfer) and keep its state.
    grow_and_lose_the_new_rank(agents, 44, kill="mid")


def test_steps_of_an_unknown_strategy_are_refused_with_a_clear_error(agents: dict[str, RayBackend]) -> None:
    payload = step(43, "m43-1", 0, "pause_workers", ["j43-rollout-w0"], [])
    payload["step"]["strategy"] = "teleport"
    with pytest.raises(
        StepFailed, match=r"inference engines \(workload\); teleport steps \(pause_workers\) are not among"
    ):
        agents["node-a"].execute_step(payload)
