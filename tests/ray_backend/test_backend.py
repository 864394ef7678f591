"""The ``ray`` backend as two node agents drive it: workers launched on their nodes, one driver
for the job, iterations run as the control plane opens them, telemetry measured from the workers,
and a dead worker reported as the job's failure. The control plane's side is played by the test
(the live stack's tests run it for real)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import ray

from agents.backends.ray import LOOPBACK_ENV, driver_client
from agents.backends.ray.backend import RayBackend
from jobs.spec import parse_spec
from runtime.engine.client import EngineClient
from tests.ray_cluster import NAMESPACE, LocalRayCluster
from tests.services import REPO_ROOT

ITERATIONS = 3


def tiny_spec(
    name: str, engine: str = "auto", actors: int = 2, reference: int = 0, iterations: int = ITERATIONS
) -> dict[str, Any]:
    """A tiny math job; with ``reference`` inference engines (one may go) and a KL term to them."""
    components: list[dict[str, Any]] = [
        {"name": "rollout", "kind": "rollout", "workers": 2},
        {"name": "reward", "kind": "reward", "workers": 1},
        {"name": "actor", "kind": "actor", "workers": actors, "min_workers": 1, "max_workers": 2},
    ]
    if reference:
        components.append({"name": "reference", "kind": "inference", "workers": reference, "min_workers": 1})
    return parse_spec(
        {
            "name": name,
            "backend": "ray",
            "model": {"name": "tiny-gpt", "params_b": 0.00002},
            "workload": {
                "iterations": iterations,
                "prompts_per_iteration": 4,
                "samples_per_prompt": 2,
                "max_new_tokens": 40,
            },
            "runtime": {
                "model": {
                    "hidden_size": 32,
                    "num_layers": 1,
                    "num_heads": 2,
                    "ffn_hidden_size": 64,
                    "max_positions": 64,
                },
                "task": {"max_digits": 2},
                "warm_start_steps": 10,
                "micro_batch_size": 4,
                "engine": engine,
                "kl_coef": 0.05 if reference else 0.0,
            },
            "components": components,
            "policy": {"name": "static-disaggregated"},
        }
    ).to_json()


def worker(job: int, group: str, index: int, kind: str, device: int) -> dict[str, Any]:
    return {
        "worker": f"j{job}-{group}-w{index}",
        "job": job,
        "group": group,
        "kind": kind,
        "tp": 1,
        "pp": 1,
        "devices": [{"uid": f"x/gpu{device}", "index": device, "hardware": "ray-logical", "shared": False}],
    }


def layout(job: int) -> dict[str, list[dict[str, Any]]]:
    return {
        "node-a": [
            worker(job, "rollout", 0, "rollout", 0),
            worker(job, "actor", 0, "actor", 1),
            worker(job, "reward", 0, "reward", 2),
        ],
        "node-b": [worker(job, "rollout", 1, "rollout", 0), worker(job, "actor", 1, "actor", 1)],
    }


def picture(job: int, iteration: int) -> dict[str, Any]:
    groups: dict[str, dict[str, Any]] = {}
    for workers in layout(job).values():
        for w in workers:
            groups.setdefault(w["group"], {"kind": w["kind"], "workers": []})["workers"].append(w["worker"])
    return {"jobs": {str(job): {"iteration": iteration, "state": "running", "groups": groups}}}


def observe_layout(
    agents: dict[str, RayBackend],
    job: int,
    placed: Mapping[str, list[dict[str, Any]]],
    iteration: int,
    groups: Mapping[str, tuple[str, list[str]]] = {},
) -> None:
    """Every agent hands the job's driver the control plane's picture: iteration ``iteration``
    opened, the groups as ``placed`` lays them out, except ``groups`` (name -> kind, members)."""
    picture: dict[str, dict[str, Any]] = {}
    for workers in placed.values():
        for w in workers:
            if w["group"] not in groups:
                picture.setdefault(w["group"], {"kind": w["kind"], "workers": []})["workers"].append(
                    w["worker"]
                )
    for group, (kind, members) in groups.items():
        picture[group] = {"kind": kind, "workers": members}
    for backend in agents.values():
        backend.observe_control(
            {"jobs": {str(job): {"iteration": iteration, "state": "running", "groups": picture}}}
        )


def launch(agents: dict[str, RayBackend], job: int) -> None:
    spec = tiny_spec(f"job-{job}")
    for node, workers in layout(job).items():
        outcome = agents[node].launch_workers({"job": job, "spec": spec}, workers)
        assert outcome["ok"], outcome


def entry_until(
    backend: RayBackend, job: int, done: Callable[[dict[str, Any]], bool], timeout_s: float = 240.0
) -> dict[str, Any]:
    """The backend's heartbeat entry for ``job`` once ``done`` holds (polled as a heartbeat would)."""
    deadline = time.monotonic() + timeout_s
    while True:
        entries = {e["job"]: e for e in backend.telemetry().jobs}
        entry = entries.get(job)
        if entry is not None and done(entry):
            return entry
        assert time.monotonic() < deadline, f"job {job}'s entry never got there: {entry}"
        time.sleep(0.2)


def read_as_a_restarted_agent(address: str, job: int) -> dict[str, Any]:
    """What a new agent process reads of a running job (its driver's progress, a trainer rank's
    usage), and which modules of the training stack it had to import for that."""
    script = (
        "import json, sys\n"
        "import ray\n"
        "from agents.backends.ray import driver_client\n"
        "from agents.backends.ray.actors import worker_handle\n"
        "from agents.backends.ray.connection import connect\n"
        f"connect({address!r}, namespace={NAMESPACE!r})\n"
        f"progress = driver_client.driver_progress({job})\n"
        f"usage = ray.get(worker_handle('node-a', 'j{job}-actor-w0').usage.remote(), timeout=60)\n"
        "heavy = ('runtime.rl.trainer', 'runtime.rl.loop', 'agents.backends.ray.driver',\n"
        "         'agents.backends.ray.trainer_rank')\n"
        "loaded = sorted(m for m in sys.modules if m in heavy or m == 'megatron' or m.startswith('megatron.'))\n"
        "print(json.dumps({'trained': progress['trained_iteration'], 'busy_s': usage.busy_s, 'imported': loaded}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **LOOPBACK_ENV},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    answer: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return answer


def test_a_job_runs_its_iterations_as_the_control_plane_opens_them(
    agents: dict[str, RayBackend], ray_cluster: LocalRayCluster
) -> None:
    job = 31
    launch(agents, job)
    assert sorted(agents["node-a"].running_workers()) == [
        f"j{job}-actor-w0",
        f"j{job}-reward-w0",
        f"j{job}-rollout-w0",
    ]
    # Nothing runs before the control plane opens iteration 0.
    assert agents["node-b"].telemetry().jobs[0]["trained_iteration"] is None
    for iteration in range(ITERATIONS):
        for backend in agents.values():
            backend.observe_control(picture(job, iteration))
        entry = entry_until(agents["node-b"], job, lambda e, k=iteration: e["trained_iteration"] == k)
        assert entry["iteration"] == iteration and "failure" not in entry
        # node-b's part: its rollout engine's samples and the trainer gang's trained samples.
        assert entry["groups"]["actor"] == {"completed": 8, "assigned": 8}
        assert 0 <= entry["groups"]["rollout"]["completed"] <= 8
    results = entry["results"]
    assert [r["iteration"] for r in results] == list(range(ITERATIONS))
    assert [r["weight_version"] for r in results] == [str(k + 1) for k in range(ITERATIONS)]
    assert all(r["samples"] == 8 and 0.0 <= r["mean_reward"] <= 1.0 for r in results)
    node_a = entry_until(agents["node-a"], job, lambda e: e["trained_iteration"] == ITERATIONS - 1)
    assert node_a["groups"]["rollout"]["completed"] + entry["groups"]["rollout"]["completed"] == 8
    # Every rollout engine holds the trainer's last weights.
    for node, backend in agents.items():
        handle = ray.get_actor(backend.actor_of(f"j{job}-rollout-w{0 if node == 'node-a' else 1}"))
        assert EngineClient(ray.get(handle.url.remote(), timeout=30)).weight_version() == str(ITERATIONS)
    # Measured telemetry: the trainer ranks worked, the engines generated tokens.
    readings = {r.worker: r for r in agents["node-a"].telemetry().workers}
    assert (
        readings[f"j{job}-rollout-w0"].tokens >= 0 and 0.0 <= readings[f"j{job}-actor-w0"].utilisation <= 1.0
    )
    # An agent restarted now reads the job's driver and its trainer's ranks without importing the
    # training stack: their classes reach it from the cluster, not from their modules.
    restarted = read_as_a_restarted_agent(ray_cluster.address, job)
    assert restarted["trained"] == ITERATIONS - 1 and restarted["busy_s"] > 0, restarted
    assert restarted["imported"] == [], restarted
    # A worker stopped on purpose while a telemetry pass, which listed it just before, asks it
    # for its usage: the pass finds its actor gone and must not take that for a death.
    on_a = agents["node-a"]
    listed = dict(on_a._payloads)
    assert on_a.stop_workers(job, [f"j{job}-reward-w0"])["ok"]
    on_a._usages(listed)
    assert all("failure" not in e for e in on_a.telemetry().jobs if e["job"] == job)
    # The job finished: its workers stop, and with the last of them its driver.
    for node, workers in layout(job).items():
        assert agents[node].stop_workers(job, [w["worker"] for w in workers])["ok"]
    assert driver_client.job_actors(job) == [] and driver_client.driver_handle(job) is None


def test_a_job_placed_anew_after_its_trainer_trained_the_iteration_to_redo_counts_it_trained(
    agents: dict[str, RayBackend],
) -> None:
    """A re-placement's stop can reach the driver after its trainer trained the iteration the new
    layout was to redo (an iteration's steps end well within the control plane's round trip, and
    a trainer-bound job spends most of an iteration in them). The state after that iteration is
    kept, the new layout's driver takes it as trained and reports its result again, and the job
    goes on from the next iteration: every weight version once, nothing trained twice."""
    job = 37
    launch(agents, job)
    for iteration in (0, 1):
        observe_layout(agents, job, layout(job), iteration)
        entry = entry_until(
            agents["node-b"], job, lambda e, k=iteration: e["trained_iteration"] == k or "failure" in e
        )
        assert "failure" not in entry, entry
    # The control plane places the job anew at the boundary it saw into iteration 1.
    stops = [
        agents[node].stop_workers(job, [w["worker"] for w in workers], redo_from_iteration=1)
        for node, workers in layout(job).items()
    ]
    kept = [stop["trainer_state"][str(job)] for stop in stops]
    assert all(outcome["kept"] and outcome["iteration"] == 1 for outcome in kept), kept

    relaid = {
        node: [{**w, "worker": w["worker"].replace("-w", "-p1w")} for w in workers]
        for node, workers in layout(job).items()
    }
    for node, workers in relaid.items():
        assert agents[node].launch_workers({"job": job, "spec": tiny_spec(f"job-{job}")}, workers)["ok"]
    observe_layout(agents, job, relaid, 1)
    entry = entry_until(agents["node-b"], job, lambda e: e["trained_iteration"] == 1 or "failure" in e)
    assert "failure" not in entry, entry
    assert [(r["iteration"], r["weight_version"]) for r in entry["results"]] == [(1, "2")]
    observe_layout(agents, job, relaid, 2)
    entry = entry_until(agents["node-b"], job, lambda e: e["trained_iteration"] == 2 or "failure" in e)
    assert "failure" not in entry, entry
    assert [(r["iteration"], r["weight_version"]) for r in entry["results"]] == [(1, "2"), (2, "3")]
    for node, workers in relaid.items():
        assert agents[node].stop_workers(job, [w["worker"] for w in workers])["ok"]
    assert driver_client.job_actors(job) == [] and driver_client.driver_handle(job) is None


@pytest.mark.parametrize(("job", "group"), [(32, "rollout"), (36, "actor")])
def test_a_worker_that_dies_fails_the_job_with_a_readable_reason(
    agents: dict[str, RayBackend], job: int, group: str
) -> None:
    """An engine, or a trainer rank: the agent of its node reports the job failed, naming it."""
    launch(agents, job)
    agents["node-b"].telemetry()  # a first reading of each worker
    ray.kill(ray.get_actor(agents["node-b"].actor_of(f"j{job}-{group}-w1")), no_restart=True)
    for backend in agents.values():
        backend.observe_control(picture(job, 0))
    on_b = entry_until(agents["node-b"], job, lambda e: "failure" in e)
    assert on_b["failure"] == f"worker j{job}-{group}-w1 on node-b died (its Ray actor is gone)"
    if group == "rollout":
        # The driver's loop fails on the engine's calls and names the worker too. (A trainer
        # rank's peer may instead wait in a collective until the control plane, told by node-b,
        # stops the job's workers, as below.)
        on_a = entry_until(agents["node-a"], job, lambda e: "failure" in e)
        assert f"worker j{job}-rollout-w1" in on_a["failure"]
    for node, workers in layout(job).items():
        agents[node].stop_workers(job, [w["worker"] for w in workers])
    assert driver_client.job_actors(job) == [] and driver_client.driver_handle(job) is None


def test_after_its_agent_comes_back_a_starting_worker_is_not_lost_but_a_running_one_without_actor_is(
    agents: dict[str, RayBackend],
) -> None:
    """The registration reply lists what the control plane expects on the node: a worker still
    starting gets its launch command (again); one it has running whose actor is gone is lost."""
    backend = agents["node-b"]
    starting = {**worker(41, "rollout", 1, "rollout", 0), "state": "starting"}
    result = backend.reconcile([starting], {"41": tiny_spec("job-41")})
    assert result == {"stopped": [], "relaunched": []}
    assert backend.telemetry().jobs == []  # nothing watched, nothing lost
    running = {**worker(42, "actor", 1, "actor", 1), "state": "running"}
    backend.reconcile([running], {"42": tiny_spec("job-42")})
    [entry] = [e for e in backend.telemetry().jobs if e["job"] == 42] or [{"failure": None}]
    assert entry.get("failure") == "worker j42-actor-w1 on node-b was gone when its agent came back"


def test_the_launch_record_says_which_engine_serves_and_a_job_insisting_on_sglang_is_refused(
    agents: dict[str, RayBackend],
) -> None:
    job = 34
    workers = layout(job)["node-b"][:1]
    outcome = agents["node-b"].launch_workers({"job": job, "spec": tiny_spec(f"job-{job}")}, workers)
    assert outcome["ok"], outcome
    (described,) = outcome["engines"].values()
    # No SGLang and no CUDA here: the stand-in serves, and the record says why.
    assert described["engine"] == "cpu" and described["note"].startswith("CPU stand-in for SGLang: ")
    agents["node-b"].stop_workers(job, [w["worker"] for w in workers])

    job = 35
    workers = layout(job)["node-b"][:1]
    outcome = agents["node-b"].launch_workers(
        {"job": job, "spec": tiny_spec(f"job-{job}", "sglang")}, workers
    )
    assert not outcome["ok"]
    error = outcome["workers"][workers[0]["worker"]]["error"]
    assert "did not start" in error and "the job asks for SGLang engines, but" in error, error
