"""The reference's ``inference`` engines move by ``workload`` on Ray, as the rollout's do: the agents
carry out the steps the control plane plans (scheduler/core/migration.py) while a real job on the
two-node loopback cluster trains. A leaving engine stops getting reference requests, lets the ones
it has finish, and stops; a new engine loads the frozen warm-start weights before it joins; a
paused engine that the rollback resumes serves again. The job's KL term is computed all along."""

from __future__ import annotations

import math
import time
from typing import Any

import ray

from agents.backends.ray import driver as job_driver
from agents.backends.ray import driver_client
from agents.backends.ray.backend import RayBackend
from runtime.engine.client import EngineClient
from runtime.rl.job import INITIAL_WEIGHT_VERSION
from tests.ray_backend.test_backend import entry_until, observe_layout, tiny_spec, worker
from tests.ray_backend.test_p2p import run_steps
from tests.ray_backend.test_p2p import step as p2p_step

JOB = 43


def spec() -> dict[str, Any]:
    return tiny_spec(f"job-{JOB}", actors=1, reference=2, iterations=5)


def name(group: str, index: int) -> str:
    return f"j{JOB}-{group}-w{index}"


LAYOUT = {
    "node-a": [
        worker(JOB, "rollout", 0, "rollout", 0),
        worker(JOB, "actor", 0, "actor", 1),
        worker(JOB, "reward", 0, "reward", 2),
        worker(JOB, "reference", 0, "inference", 3),
    ],
    "node-b": [worker(JOB, "rollout", 1, "rollout", 0), worker(JOB, "reference", 1, "inference", 1)],
}


def observe(agents: dict[str, RayBackend], iteration: int, reference: list[str]) -> None:
    """The control plane's picture of the job, with ``reference`` as its inference engines."""
    observe_layout(agents, JOB, LAYOUT, iteration, {"reference": ("inference", reference)})


def trained(agents: dict[str, RayBackend], iteration: int) -> dict[str, Any]:
    entry = entry_until(
        agents["node-a"], JOB, lambda e: e.get("trained_iteration") == iteration or "failure" in e
    )
    assert "failure" not in entry, entry
    result: dict[str, Any] = entry["results"][-1]
    assert result["iteration"] == iteration and result["samples"] == 8
    # The KL term to the reference was computed from the reference engines' log-probs.
    assert result["kl"] is not None and math.isfinite(result["kl"]), result
    return result


def step(migration: str, index: int, kind: str, workers: list[str], devices: list[str]) -> dict[str, Any]:
    return p2p_step(JOB, migration, index, kind, workers, devices, group="reference", strategy="workload")


def served(engine: str) -> int:
    """Requests the engine finished so far (reference requests: it serves nothing else)."""
    return int(ray.get(job_driver.worker_actor(engine).usage.remote()).items)


def test_reference_engines_leave_and_join_by_workload_while_the_job_trains(
    agents: dict[str, RayBackend],
) -> None:
    for node, workers in LAYOUT.items():
        outcome = agents[node].launch_workers({"job": JOB, "spec": spec()}, workers)
        assert outcome["ok"], outcome
    staying, leaving = name("reference", 0), name("reference", 1)
    observe(agents, 0, [staying, leaving])
    trained(agents, 0)
    assert served(staying) > 0 and served(leaving) > 0  # both scored

    # Shrink, planned for node-b's engine, while iteration 1 runs (generating or scoring).
    observe(agents, 1, [staying, leaving])
    shrink = "m43-1"
    run_steps(
        agents,
        [
            step(shrink, 0, "pause_workers", [leaving], ["node-b/gpu1"]),
            step(shrink, 1, "take_back_requests", [leaving], ["node-b/gpu1"]),
            step(shrink, 2, "redistribute_requests", [staying], ["node-a/gpu3"]),
            step(shrink, 3, "release_devices", [leaving], ["node-b/gpu1"]),
        ],
    )
    assert not [a for a in driver_client.job_actors(JOB) if a.endswith(leaving)]  # its agent stopped it
    observe(agents, 1, [staying])
    trained(agents, 1)
    before = served(staying)
    observe(agents, 2, [staying])
    trained(agents, 2)
    assert served(staying) > before  # it scores alone now

    # Grow back onto node-b with a new engine: it starts, loads the reference's frozen weights
    # (not the trainer's current ones) and joins at the switch.
    grow, new = "m43-2", "reference-m43-2-w0"
    run_steps(
        agents,
        [
            step(grow, 0, "start_workers", [new], ["node-b/gpu1"]),
            step(grow, 1, "health_check", [new], ["node-b/gpu1"]),
            step(grow, 2, "switch", [staying, new], ["node-a/gpu3", "node-b/gpu1"]),
        ],
    )
    url = ray.get(job_driver.worker_actor(new).url.remote())
    assert EngineClient(url).weight_version() == INITIAL_WEIGHT_VERSION
    observe(agents, 3, [staying, new])
    result = trained(agents, 3)
    assert result["weight_version"] == "4"  # the trainer's weights moved on; the reference did not
    assert served(new) > 0

    # A rolled-back shrink: paused, then resumed by the compensation; the engine serves again.
    back = "m43-3"
    run_steps(agents, [step(back, 0, "pause_workers", [new], ["node-b/gpu1"])])
    run_steps(agents, [step(back, 0, "resume_workers", [new], ["node-b/gpu1"])])
    before = served(new)
    observe(agents, 4, [staying, new])
    trained(agents, 4)
    assert served(new) > before


GROWING = 44
GROWING_LAYOUT = {
    "node-a": [
        worker(GROWING, "rollout", 0, "rollout", 0),
        worker(GROWING, "actor", 0, "actor", 1),
        worker(GROWING, "reward", 0, "reward", 2),
    ],
    "node-b": [],
}


def rollout_step(
    migration: str, index: int, kind: str, workers: list[str], devices: list[str], share: float = 0.0
) -> dict[str, Any]:
    return p2p_step(
        GROWING, migration, index, kind, workers, devices, group="rollout", strategy="workload", share=share
    )


def observe_growing(agents: dict[str, RayBackend], iteration: int, rollout: list[str]) -> None:
    observe_layout(agents, GROWING, GROWING_LAYOUT, iteration, {"rollout": ("rollout", rollout)})


def test_a_rollout_growing_mid_generation_hands_its_new_engine_a_share_of_the_batch(
    agents: dict[str, RayBackend],
) -> None:
    spec = tiny_spec(f"job-{GROWING}", actors=1, iterations=2)
    for node, workers in GROWING_LAYOUT.items():
        if workers:
            outcome = agents[node].launch_workers({"job": GROWING, "spec": spec}, workers)
            assert outcome["ok"], outcome
    old, new = f"j{GROWING}-rollout-w0", "rollout-m44-1-w0"
    observe_growing(agents, 0, [old])
    entry = entry_until(
        agents["node-a"], GROWING, lambda e: e.get("trained_iteration") == 0 or "failure" in e
    )
    assert "failure" not in entry, entry

    # The new engine starts before the iteration opens; the old one is slowed (SGLang's
    # /slow_down) so that the whole batch, sent to it when the iteration opens, is still being
    # generated when the new engine joins.
    migration = "m44-1"
    run_steps(
        agents,
        [
            rollout_step(migration, 0, "start_workers", [new], ["node-b/gpu0"]),
            rollout_step(migration, 1, "health_check", [new], ["node-b/gpu0"]),
        ],
    )
    slow = EngineClient(ray.get(job_driver.worker_actor(old).url.remote()))
    slow.slow_down(0.5)
    observe_growing(agents, 1, [old])
    driver = driver_client.driver_handle(GROWING)

    def generating() -> bool:
        progress = ray.get(driver.progress.remote())
        return progress["phase"] == "generating" and sum(t - d for d, t in progress["samples"].values()) == 8

    deadline = time.monotonic() + 60
    while not generating():
        assert time.monotonic() < deadline, ray.get(driver.progress.remote())
        time.sleep(0.05)
    outcomes = [
        agents[node].execute_step(payload)
        for payload in [
            rollout_step(migration, 2, "switch", [old, new], ["node-a/gpu0", "node-b/gpu0"]),
            rollout_step(migration, 3, "shed_requests", [old], ["node-a/gpu0"], share=0.5),
            rollout_step(migration, 4, "redistribute_requests", [new], ["node-b/gpu0"]),
        ]
        for node in sorted(agents)
    ]
    slow.slow_down(None)
    shed = outcomes[2]["shed"]  # node-a's answer to shed_requests (both nodes get the same)
    assert len(shed) == 4 and outcomes[3]["shed"] == shed  # half the batch: two groups of two
    observe_growing(agents, 1, [old, new])
    entry = entry_until(
        agents["node-a"], GROWING, lambda e: e.get("trained_iteration") == 1 or "failure" in e
    )
    assert "failure" not in entry, entry
    result = entry["results"][-1]
    # Every sample once. The shed ones that had not finished when aborted were resumed, on the
    # least loaded engine: the new one took its share of the batch in the iteration it joined.
    assert result["samples"] == 8 and sum(result["samples_per_engine"]) == 8
    assert 1 <= result["resumed_samples"] <= 4
    assert result["samples_per_engine"][1] >= 1
