"""Colocated workers on the sim backend: groups of one job time-sharing devices take turns (verl's
and RLinf's colocated mode), with the core simulator's stage-switch cost; two jobs never share a
device; migration steps refuse time-shared workers."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator

import pytest

from agents.backends.base import StepFailed, WorkerReading
from agents.backends.sim.backend import ManualClock
from tests.sim_backend.relay import Relay, manual_backends, math_spec, run_until
from tests.sim_backend.test_backend import collect, step

JOB = 7
PREFIX = {"rollout": "r", "reward": "s", "actor": "a"}  # worker names: r0, r1, s0, s1, a0, a1


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(autouse=True)
def no_env_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("DYNARL_SIM_FAULTS", raising=False)
    yield


def colocated(clock: ManualClock, *, iterations: int = 2, job: int = JOB) -> Relay:
    """Rollout, reward and actor, two workers each, all on devices 0 and 1 of one host (the
    placement ``actor,rollout,reward: 0-1``)."""
    # A sample every 0.1 virtual seconds: even the shortest stage (scoring) spans several.
    backends = manual_backends("a", clock=clock, sample_interval_s=0.01)
    spec = math_spec(
        rollout=2, actor=2, reward=2, prompts=16, samples=8, max_new_tokens=2048, iterations=iterations
    )
    relay = Relay(job, spec, backends)
    workers = [(f"{prefix}{w}", group, [w]) for group, prefix in PREFIX.items() for w in range(2)]
    outcome = relay.launch_together("a", workers, shared=True)
    assert outcome["ok"], outcome
    return relay


def run(relay: Relay, clock: ManualClock, rounds: int = 2000) -> list[WorkerReading]:
    samples: list[WorkerReading] = []
    for _ in range(rounds):
        samples.extend(collect(relay, clock, 1, 0.1))
        if relay.iteration >= relay.iterations:
            return samples
    raise AssertionError(f"the job stopped at iteration {relay.iteration}")


def test_groups_of_one_job_share_devices_and_take_turns_stage_by_stage(clock: ManualClock) -> None:
    relay = colocated(clock)
    backend = relay.backends["a"]
    assert backend.running_workers() == ["a0", "a1", "r0", "r1", "s0", "s1"]
    samples = run(relay, clock)
    assert relay.advanced == [1, 2], "the colocated job ran its iterations to the end"

    device_of = {f"{p}{w}": w for p in PREFIX.values() for w in range(2)}
    group_of = {f"{p}{w}": g for g, p in PREFIX.items() for w in range(2)}
    assert {s.worker for s in samples} == set(device_of)
    assert all(s.turn in ("active", "onloading", "offloaded") for s in samples)
    # One stage at a time on a device: at every sample instant, at most one worker is active on it,
    # and only an active worker works.
    by_instant: dict[float, list[WorkerReading]] = defaultdict(list)
    for s in samples:
        by_instant[s.at].append(s)
    for at, instant in by_instant.items():
        for device in (0, 1):
            active = [s.worker for s in instant if device_of[s.worker] == device and s.turn == "active"]
            assert len(active) <= 1, (at, active)
    # A worker does nothing while it waits for its turn or is being switched in.
    for name in device_of:
        own = [s for s in samples if s.worker == name]
        for before, after in itertools.pairwise(own):
            if before.turn != "active" and after.turn != "active":
                assert after.utilisation == 0 and after.tokens == 0 and after.in_flight == 0, after
    for name in device_of:
        turns = {s.turn for s in samples if s.worker == name}
        assert {"active", "offloaded"} <= turns, (name, turns)
        assert any(s.tokens > 0 for s in samples if s.worker == name), f"{name} never worked"

    # The stages follow the iteration: generate, score, train, and again for the second iteration.
    order = [
        group_of[s.worker]
        for s in sorted(samples, key=lambda s: s.at)
        if device_of[s.worker] == 0 and s.turn == "active"
    ]
    stages = [group for group, _ in itertools.groupby(order)]
    assert stages == ["rollout", "reward", "actor", "rollout", "reward", "actor"], stages
    # Switching the rollout out and in costs the colocated switch (the stage loads meanwhile);
    # reward and training run in the trainer's process, so the switch between them is free.
    assert any(s.turn == "onloading" for s in samples if group_of[s.worker] == "reward")
    assert any(s.turn == "onloading" for s in samples if group_of[s.worker] == "rollout")
    assert not any(s.turn == "onloading" for s in samples if group_of[s.worker] == "actor")


def test_a_colocated_engine_has_the_smaller_kv_pool_of_a_shared_gpu(clock: ManualClock) -> None:
    relay = colocated(clock)
    alone = Relay(8, relay.spec, manual_backends("b", clock=clock))
    assert alone.launch("r9", "b", "rollout", [0])["ok"]
    with relay.backends["a"].lock, alone.backends["b"].lock:
        shared_engine = relay.backends["a"].simulation.workers["r0"].engine
        own_engine = alone.backends["b"].simulation.workers["r9"].engine
        assert shared_engine is not None and own_engine is not None
        assert shared_engine.capacity < own_engine.capacity


def test_a_worker_left_alone_on_its_devices_runs_without_turns(clock: ManualClock) -> None:
    relay = colocated(clock, iterations=3)
    backend = relay.backends["a"]
    # The first iteration trained: the rollout waits to be switched back in for the second.
    while relay.iteration < 1:
        collect(relay, clock, 1, 0.1)
    with backend.lock:
        assert backend.simulation.workers["r0"].offloaded
    backend.stop_workers(JOB, ["s0", "s1", "a0", "a1"])
    stopped_at = clock.now()
    for name in ("s0", "s1", "a0", "a1"):
        relay.placement.pop(name)
    samples = collect(relay, clock, 5, 0.1)
    rollout = [s for s in samples if s.worker in ("r0", "r1") and s.at > stopped_at]
    assert rollout and all(s.turn is None for s in rollout)
    assert any(s.utilisation > 0 for s in rollout)


def test_two_jobs_never_share_a_device(clock: ManualClock) -> None:
    relay = colocated(clock)
    backend = relay.backends["a"]
    other = Relay(8, relay.spec, {"a": backend})
    clash = other.launch("x0", "a", "rollout", [0], shared=True)
    assert not clash["ok"]
    assert "a/gpu0 is held by" in clash["workers"]["x0"]["error"]
    assert "of job 7" in clash["workers"]["x0"]["error"]
    # Nor does a worker the control plane did not give the device as shared, nor two workers of
    # one group.
    unmarked = Relay(JOB, relay.spec, {"a": backend}).launch("r7", "a", "rollout", [1])
    assert not unmarked["ok"] and "a/gpu1 is held by" in unmarked["workers"]["r7"]["error"]
    same_group = Relay(JOB, relay.spec, {"a": backend}).launch("r8", "a", "rollout", [1], shared=True)
    assert not same_group["ok"] and "same group" in same_group["workers"]["r8"]["error"]
    assert "x0" not in backend.running_workers() and "r7" not in backend.running_workers()
    # A free device is still anyone's.
    assert other.launch("x1", "a", "rollout", [5])["ok"]


def test_migration_steps_refuse_time_shared_workers_and_devices(clock: ManualClock) -> None:
    relay = colocated(clock)
    backend = relay.backends["a"]
    collect(relay, clock, 5, 0.1)
    for kind, workers, devices, group in (
        ("pause_workers", ["r0"], ["a/gpu0"], "rollout"),
        ("drain", ["s1"], ["a/gpu1"], "reward"),
        ("reserve_devices", [], ["a/gpu1"], "actor"),
        ("release_devices", ["a0"], ["a/gpu0"], "actor"),
    ):
        with pytest.raises(StepFailed, match="time-share devices"):
            backend.execute_step(step(kind, workers, devices, group=group, strategy="workload"))
    assert sorted(backend.running_workers()) == sorted(relay.placement)
    assert backend.worker_state("r0") == "running"
    # Undoing what never ran is harmless, so compensations are not refused.
    backend.execute_step(step("resume_workers", ["r0"], ["a/gpu0"], index=1, group="rollout"))
    assert backend.worker_state("r0") == "running"


def test_a_job_placed_anew_mid_iteration_redoes_that_iteration_on_its_new_workers_and_finishes(
    clock: ManualClock,
) -> None:
    """What a placement change does on the hosts: every worker of the job stops with
    ``redo_from_iteration``, the control plane forgets the iteration's partition and the nodes'
    reports, and the new (colocated) layout's workers redo the iteration from its start."""
    backends = manual_backends("a", clock=clock, sample_interval_s=0.01)
    spec = math_spec(rollout=2, actor=2, prompts=16, samples=8, max_new_tokens=2048, iterations=3)
    relay = Relay(JOB, spec, backends)
    assert relay.launch_together("a", [("r0", "rollout", [0]), ("r1", "rollout", [1])])["ok"]
    assert relay.launch_together("a", [("a0", "actor", [2]), ("a1", "actor", [3])])["ok"]

    def rollout_done_in_iteration_1() -> int:
        entry = relay.entries.get("a", {})
        return int(entry["groups"]["rollout"]["completed"]) if entry.get("iteration") == 1 else 0

    run_until(relay, clock, lambda: rollout_done_in_iteration_1() > 0, step_s=0.05)
    backend = relay.backends["a"]
    result = backend.stop_workers(JOB, ["r0", "r1", "a0", "a1"], redo_from_iteration=1)
    assert result["ok"] and backend.running_workers() == []
    [entry] = [e for e in backend.telemetry().jobs if e["job"] == JOB]
    assert entry["iteration"] == 1
    assert all(group["completed"] == 0 for group in entry["groups"].values()), entry
    assert not entry.get("claims", {}).get("1")
    # The control plane's part (agents.services.progress.redo_from).
    relay.placement.clear()
    relay.entries.clear()
    relay.partitions = {i: p for i, p in relay.partitions.items() if i < 1}
    relay.claims = {key: names for key, names in relay.claims.items() if key[0] < 1}

    new = [("r2", "rollout", [0]), ("r3", "rollout", [1]), ("a2", "actor", [0]), ("a3", "actor", [1])]
    assert relay.launch_together("a", new, shared=True)["ok"]
    run(relay, clock)
    assert relay.advanced == [1, 2, 3], "the job finished on its new layout"
    assert relay.partitions[1] == {"rollout": ["r2", "r3"]}, "iteration 1 was split over the new members"
