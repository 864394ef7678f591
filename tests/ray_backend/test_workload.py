"""The reference's ``inference`` engines move by ``workload`` on Ray, as the rollout's do: the agents
carry out the steps the control plane plans (scheduler/core/migration.py) while a real job on the
two-node loopback cluster trains. A leaving engine stops getting reference requests, lets the ones
it has finish, and stops; a new engine loads the frozen warm-start weights before it joins; a
paused engine that the rollback resumes serves again. The job's KL term is computed all along."""

from __future__ import annotations

import math
from typing import Any

import ray

from agents.backends.ray import driver as job_driver
from agents.backends.ray.backend import RayBackend
from runtime.engine.client import EngineClient
from runtime.rl.job import INITIAL_WEIGHT_VERSION
from tests.ray_backend.test_backend import entry_until, tiny_spec, worker

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
    groups: dict[str, dict[str, Any]] = {}
    for workers in LAYOUT.values():
        for w in workers:
            if w["group"] != "reference":
                groups.setdefault(w["group"], {"kind": w["kind"], "workers": []})["workers"].append(
                    w["worker"]
                )
    groups["reference"] = {"kind": "inference", "workers": reference}
    for backend in agents.values():
        backend.observe_control(
            {"jobs": {str(JOB): {"iteration": iteration, "state": "running", "groups": groups}}}
        )


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
    return {
        "migration": migration,
        "job": JOB,
        "attempt": 1,
        "is_rollback": False,
        "step": {
            "step_id": f"{migration}:{index:02d}:{kind}",
            "index": index,
            "kind": kind,
            "group_id": "reference",
            "strategy": "workload",
            "device_ids": devices,
            "worker_ids": workers,
        },
    }


def run_steps(agents: dict[str, RayBackend], payloads: list[dict[str, Any]]) -> None:
    for payload in payloads:
        for node in sorted(agents):
            agents[node].execute_step(payload)


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
    assert not [a for a in job_driver.job_actors(JOB) if a.endswith(leaving)]  # its agent stopped it
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
