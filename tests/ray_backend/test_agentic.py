"""The agentic variant of the real job on Ray: multi-turn episodes whose calculator calls go to
``tool`` workers, dispatched to the rollout engines by the DataRouter, while the tool group
shrinks and grows by ``restart`` as the control plane plans it (scheduler/core/migration.py)."""

from __future__ import annotations

from typing import Any

import pytest
import ray

from agents.backends.base import StepFailed
from agents.backends.ray import driver as job_driver
from agents.backends.ray import driver_client
from agents.backends.ray.backend import RayBackend
from jobs.spec import parse_spec
from tests.ray_backend.test_backend import entry_until, observe_layout, worker
from tests.ray_backend.test_p2p import run_steps
from tests.ray_backend.test_p2p import step as p2p_step

JOB = 45
ITERATIONS = 4


def spec() -> dict[str, Any]:
    return parse_spec(
        {
            "name": f"job-{JOB}",
            "backend": "ray",
            "model": {"name": "tiny-gpt", "params_b": 0.00002},
            "workload": {
                "kind": "agentic",
                "iterations": ITERATIONS,
                "prompts_per_iteration": 4,
                "samples_per_prompt": 2,
                "max_new_tokens": 40,
                "max_turns": 3,
                "tool_latency_s": 0.005,
            },
            "runtime": {
                "model": {
                    "hidden_size": 32,
                    "num_layers": 2,
                    "num_heads": 4,
                    "ffn_hidden_size": 64,
                    "max_positions": 64,
                },
                "task": {"max_digits": 2},
                # Enough for the policy to call the calculator where the transcripts do.
                "warm_start_steps": 300,
                "micro_batch_size": 4,
                "engine": "cpu",
            },
            "components": [
                {"name": "rollout", "kind": "rollout", "workers": 2},
                {"name": "tools", "kind": "tool", "workers": 2, "min_workers": 1},
                {"name": "reward", "kind": "reward", "workers": 1},
                {"name": "actor", "kind": "actor", "workers": 1},
            ],
            "policy": {"name": "static-disaggregated"},
        }
    ).to_json()


def name(group: str, index: int) -> str:
    return f"j{JOB}-{group}-w{index}"


LAYOUT = {
    "node-a": [
        worker(JOB, "rollout", 0, "rollout", 0),
        worker(JOB, "actor", 0, "actor", 1),
        worker(JOB, "reward", 0, "reward", 2),
        worker(JOB, "tools", 0, "tool", 3),
    ],
    "node-b": [worker(JOB, "rollout", 1, "rollout", 0), worker(JOB, "tools", 1, "tool", 1)],
}


def observe(agents: dict[str, RayBackend], iteration: int, tools: list[str]) -> None:
    observe_layout(agents, JOB, LAYOUT, iteration, {"tools": ("tool", tools)})


def trained(agents: dict[str, RayBackend], iteration: int) -> dict[str, Any]:
    entry = entry_until(
        agents["node-a"], JOB, lambda e: e.get("trained_iteration") == iteration or "failure" in e
    )
    assert "failure" not in entry, entry
    result: dict[str, Any] = entry["results"][-1]
    assert result["iteration"] == iteration and result["samples"] == 8
    agentic = result["agentic"]
    # Episodes made calculator calls, each answered by a tool worker, and every follow-up turn
    # was dispatched by the DataRouter (priority routing: to the engine holding its prefix).
    assert agentic["tool_calls"] > 0, result
    assert agentic["turns"] == 8 + agentic["tool_calls"] - agentic["tool_errors"]
    assert (
        agentic["affinity_hits"] + agentic["affinity_steals"]
        == agentic["tool_calls"] - agentic["tool_errors"]
    )
    assert result["tokens_trained"] < result["tokens_generated"]  # the tools' answers are not trained
    return result


def calls(tool: str) -> int:
    return int(ray.get(job_driver.worker_actor(tool).usage.remote()).items)


def step(migration: str, index: int, kind: str, workers: list[str], devices: list[str]) -> dict[str, Any]:
    return p2p_step(JOB, migration, index, kind, workers, devices, group="tools", strategy="restart")


def test_an_agentic_job_calls_its_tool_workers_while_they_move_by_restart(
    agents: dict[str, RayBackend],
) -> None:
    for node, workers in LAYOUT.items():
        outcome = agents[node].launch_workers({"job": JOB, "spec": spec()}, workers)
        assert outcome["ok"], outcome
    staying, leaving = name("tools", 0), name("tools", 1)
    observe(agents, 0, [staying, leaving])
    trained(agents, 0)
    assert calls(staying) > 0 and calls(leaving) > 0  # calls go to the least busy tool worker

    # Shrink: node-b's tool worker drains (no new call; its calls in flight end) and stops.
    shrink = f"m{JOB}-1"
    run_steps(
        agents,
        [
            step(shrink, 0, "drain", [leaving], ["node-b/gpu1"]),
            step(shrink, 1, "stop_workers", [leaving], ["node-b/gpu1"]),
            step(shrink, 2, "release_devices", [leaving], ["node-b/gpu1"]),
        ],
    )
    assert not [a for a in driver_client.job_actors(JOB) if a.endswith(leaving)]
    before = calls(staying)
    observe(agents, 1, [staying])
    result = trained(agents, 1)
    assert calls(staying) - before == result["agentic"]["tool_calls"]  # it answered every call alone

    # Grow back onto node-b with a new tool worker, started with the job's tool latency.
    grow, new = f"m{JOB}-2", f"tools-m{JOB}-2-w0"
    run_steps(
        agents,
        [
            step(grow, 0, "start_workers", [new], ["node-b/gpu1"]),
            step(grow, 1, "health_check", [new], ["node-b/gpu1"]),
            step(grow, 2, "switch", [staying, new], ["node-a/gpu3", "node-b/gpu1"]),
        ],
    )
    observe(agents, 2, [staying, new])
    trained(agents, 2)
    assert calls(new) > 0
    assert ray.get(job_driver.worker_actor(new).call.remote("12+30")) == "42\n"
    assert ray.get(job_driver.worker_actor(new).call.remote("12+")) is None  # refused, not raised

    # A rolled-back shrink: the new worker is drained and stopped, then the compensations run
    # newest first: it is started again on its device (by name, from the step and the driver)
    # and taken back into service; it answers calls again.
    back = f"m{JOB}-3"
    run_steps(
        agents,
        [
            step(back, 0, "drain", [new], ["node-b/gpu1"]),
            step(back, 1, "stop_workers", [new], ["node-b/gpu1"]),
        ],
    )
    assert not [a for a in driver_client.job_actors(JOB) if a.endswith(new)]
    rollback = [
        step(back, 1, "restart_workers", [new], ["node-b/gpu1"]),
        step(back, 0, "undrain", [new], ["node-b/gpu1"]),
    ]
    for payload in rollback:
        payload["is_rollback"] = True
    run_steps(agents, rollback)
    assert calls(new) == 0  # a new actor: the one stopped took its count with it
    observe(agents, 3, [staying, new])
    trained(agents, 3)
    assert calls(new) > 0

    # Restarting is for stateless workers: engines are refused, naming the group.
    engines = p2p_step(
        JOB,
        f"m{JOB}-4",
        0,
        "drain",
        [name("rollout", 0)],
        ["node-a/gpu0"],
        group="rollout",
        strategy="restart",
    )
    with pytest.raises(StepFailed, match=r"restarts reward and tool workers; rollout \(rollout\) is not one"):
        agents["node-a"].execute_step(engines)
