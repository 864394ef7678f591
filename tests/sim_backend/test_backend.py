"""The sim backend on its own (no Django): workers, iterations across hosts, migration steps, faults.

Backends run on a ManualClock, so virtual time passes only when a test advances it or a step waits:
every run is deterministic and as fast as the simulation itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.backends.base import StepFailed, WorkerReading
from agents.backends.faults import FaultSpecError, parse_faults
from agents.backends.sim.backend import ManualClock, SimBackend
from tests.sim_backend.relay import Relay, manual_backends, math_spec, run_until

JOB = 7


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(autouse=True)
def no_env_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("DYNARL_SIM_FAULTS", raising=False)
    yield


def step(
    kind: str,
    workers: list[str],
    devices: list[str],
    *,
    index: int = 0,
    group: str = "actor",
    strategy: str = "p2p",
    handover: dict[str, Any] | None = None,
    attempt: int = 1,
    migration: str = "m7-1",
) -> dict[str, Any]:
    return {
        "migration": migration,
        "job": JOB,
        "attempt": attempt,
        "is_rollback": False,
        "step": {
            "step_id": f"{migration}:{index:02d}:{kind}",
            "index": index,
            "kind": kind,
            "group_id": group,
            "strategy": strategy,
            "device_ids": devices,
            "worker_ids": workers,
            "estimated_s": 0.0,
            "rollback_kind": None,
            "point_of_no_return": kind == "switch",
            "rollback_estimated_s": 0.0,
        },
        "handover": handover or {},
    }


def collect(relay: Relay, clock: ManualClock, rounds: int, step_s: float) -> list[WorkerReading]:
    samples: list[WorkerReading] = []
    for _ in range(rounds):
        for node, backend in relay.backends.items():
            telemetry = backend.telemetry()
            samples.extend(telemetry.workers)
            relay.record(node, telemetry.jobs)
        for node, backend in relay.backends.items():
            backend.observe_control(relay.reply(node))
        clock.advance(step_s)
    return samples


# --- workers and their telemetry ------------------------------------------------------------------


def test_a_rollout_worker_drains_into_a_long_tail_while_the_trainer_waits(clock: ManualClock) -> None:
    backends = manual_backends("a", clock=clock, sample_interval_s=0.1)
    relay = Relay(
        JOB, math_spec(rollout=1, actor=1, prompts=64, samples=8, max_new_tokens=4096, iterations=1), backends
    )
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("a0", "a", "actor", [1])
    samples: list[WorkerReading] = []
    for _ in range(400):
        samples.extend(collect(relay, clock, 1, 0.1))
        if relay.iteration >= 1:
            break
    rollout = [s for s in samples if s.worker == "r0"]
    trainer = [s for s in samples if s.worker == "a0"]
    busy = [s for s in rollout if s.utilisation >= 0.9]
    assert busy, "a full engine reads close to fully utilised"
    first_busy = rollout.index(busy[0])
    # The tail: stragglers still running, the engine doing a small fraction of what it could.
    tail = [s for s in rollout[first_busy:] if s.in_flight >= 1 and s.utilisation < 0.25]
    assert tail, "the engine drains into a long tail"
    assert max(s.in_flight for s in tail) < max(s.in_flight for s in rollout) / 4
    # The trainer waits for the whole iteration's samples, then trains.
    first_training = next(s for s in trainer if s.utilisation > 0)
    assert first_training.at >= max(s.at for s in rollout if s.in_flight > 0)
    assert all(s.utilisation == 0 for s in trainer if s.at < tail[-1].at)
    assert sum(s.tokens for s in trainer) > 0
    devices = backends["a"].telemetry().devices
    assert [d.index for d in devices] == list(range(8))


def test_launch_is_idempotent_and_refuses_a_busy_device(clock: ManualClock) -> None:
    backend = manual_backends("a", clock=clock)["a"]
    relay = Relay(JOB, math_spec(), {"a": backend})
    assert relay.launch("r0", "a", "rollout", [0])["ok"]
    assert relay.launch("r0", "a", "rollout", [0])["ok"]
    assert backend.running_workers() == ["r0"]
    clash = relay.launch("r1", "a", "rollout", [0])
    assert not clash["ok"]
    assert "a/gpu0" in clash["workers"]["r1"]["error"]
    assert backend.running_workers() == ["r0"]


def test_a_model_that_does_not_fit_fails_its_launch(clock: ManualClock) -> None:
    backend = manual_backends("a", clock=clock)["a"]
    spec = math_spec()
    spec["model"]["params_b"] = 70.0  # 140 GB of weights on one 80 GB GPU
    outcome = Relay(JOB, spec, {"a": backend}).launch("r0", "a", "rollout", [0])
    assert not outcome["ok"]
    assert "does not fit" in outcome["workers"]["r0"]["error"]
    assert backend.running_workers() == []


def test_stop_workers_frees_devices_and_ignores_unknown_workers(clock: ManualClock) -> None:
    backend = manual_backends("a", clock=clock)["a"]
    relay = Relay(JOB, math_spec(), {"a": backend})
    relay.launch("r0", "a", "rollout", [0])
    result = backend.stop_workers(0, ["r0", "never-ran"])  # by name: the job id only labels the call
    assert result["workers"]["never-ran"]["ok"]
    assert backend.running_workers() == []
    assert relay.launch("r1", "a", "rollout", [0])["ok"]


def test_observe_control_takes_the_reply_or_its_jobs_section(clock: ManualClock) -> None:
    backends = manual_backends("a", "b", clock=clock)
    relay = Relay(JOB, math_spec(rollout=1), backends)
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("a0", "b", "actor", [0])
    backends["a"].observe_control(relay.reply("a")["jobs"])  # the section alone
    backends["b"].observe_control({"node_status": "ready", **relay.reply("b")})  # the whole reply
    clock.advance(0.5)
    entries = {n: b.telemetry().jobs for n, b in backends.items()}
    assert entries["a"][0]["groups"]["rollout"]["assigned"] == relay.total
    assert entries["a"][0]["claims"] == {"0": {"rollout": ["r0"]}}


# --- iterations across hosts -----------------------------------------------------------------------


def test_a_synchronous_iteration_spans_two_hosts(clock: ManualClock) -> None:
    backends = manual_backends("a", "b", clock=clock)
    relay = Relay(JOB, math_spec(rollout=2, actor=1, iterations=2), backends)
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("r1", "b", "rollout", [0])
    relay.launch("a0", "b", "actor", [1])
    seen_trained_before_rollout_done = False
    for _ in range(2000):
        relay.exchange()
        # Synchronous: nobody starts iteration k + 1 before the trainer finished k.
        for entry in relay.entries.values():
            assert set(entry.get("claims", {})) <= {str(entry["iteration"])}
            assert entry["iteration"] <= relay.iteration
        reply = relay.reply("b")["jobs"][str(JOB)]
        if relay.entries["b"]["trained_iteration"] == relay.iteration and relay.iteration < 2:
            seen_trained_before_rollout_done |= reply["groups"]["rollout"]["completed"] < relay.total
        if relay.iteration >= 2:
            break
        clock.advance(0.1)
    assert relay.advanced == [1, 2]
    assert not seen_trained_before_rollout_done
    # Each host ran its half of the partition (episode i on member i mod 2).
    assert relay.partitions[1] == {"rollout": ["r0", "r1"]}
    assert relay.claims[(1, "rollout")] == {"r0", "r1"}


def test_the_last_iteration_ends_the_work(clock: ManualClock) -> None:
    backends = manual_backends("a", clock=clock)
    relay = Relay(JOB, math_spec(rollout=1, iterations=1), backends)
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("a0", "a", "actor", [1])
    run_until(relay, clock, lambda: relay.iteration >= 1)
    samples = collect(relay, clock, 20, 0.5)
    assert relay.advanced == [1]
    assert all(s.in_flight == 0 and s.tokens == 0 for s in samples[-4:])


def test_an_asynchronous_job_rolls_out_ahead_of_the_trainer(clock: ManualClock) -> None:
    backends = manual_backends("a", clock=clock)
    relay = Relay(JOB, math_spec(rollout=1, iterations=3, staleness=1), backends)
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("a0", "a", "actor", [1])
    ahead = False
    for _ in range(2000):
        relay.exchange()
        entry = relay.entries["a"]
        ahead |= relay.iteration == 0 and "1" in entry.get("claims", {})
        for claimed in entry.get("claims", {}):
            assert int(claimed) <= relay.iteration + 1  # never beyond the staleness bound
        if relay.iteration >= 3:
            break
        clock.advance(0.1)
    assert ahead
    assert relay.advanced == [1, 2, 3]


def test_log_probs_consume_what_the_rollout_completed_globally(clock: ManualClock) -> None:
    backends = manual_backends("a", "b", clock=clock)
    relay = Relay(JOB, math_spec(rollout=1, actor=1, inference=2, iterations=1), backends)
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("i0", "a", "inference", [1])
    relay.launch("i1", "b", "inference", [0])
    relay.launch("a0", "b", "actor", [1])
    for _ in range(2000):
        relay.exchange()
        entries = relay.entries
        consumed = sum(e["groups"].get("inference", {}).get("completed", 0) for e in entries.values())
        rolled = sum(e["groups"].get("rollout", {}).get("completed", 0) for e in entries.values())
        if relay.iteration == 0:
            assert consumed <= rolled
        if relay.iteration >= 1:
            break
        clock.advance(0.1)
    assert relay.advanced == [1]


def test_an_agentic_job_runs_its_turns_and_tool_calls(clock: ManualClock) -> None:
    backends = manual_backends("a", clock=clock)
    relay = Relay(
        JOB, math_spec(kind="agentic", rollout=2, prompts=8, samples=2, max_new_tokens=256), backends
    )
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("r1", "a", "rollout", [1])
    relay.launch("a0", "a", "actor", [2])
    run_until(relay, clock, lambda: relay.iteration >= 2)
    host = backends["a"].simulation
    records = host.jobs[JOB].model.records(0)
    assert any(r.turns > 1 for r in records)  # multi-turn episodes went through tool calls


def test_a_member_gone_before_its_share_started_is_adopted(clock: ManualClock) -> None:
    backend = manual_backends("a", clock=clock)["a"]
    relay = Relay(JOB, math_spec(rollout=1), {"a": backend})
    relay.launch("r0", "a", "rollout", [0])
    reply = relay.reply("a")
    part = reply["jobs"][str(JOB)]["partitions"]["0"]["rollout"]
    part["workers"] = ["r0", "r-gone"]  # frozen with a member that has left since
    part["adopt"] = {"r-gone": "r0"}
    backend.observe_control(reply)
    entry = backend.telemetry().jobs[0]
    assert entry["claims"] == {"0": {"rollout": ["r-gone", "r0"]}}
    assert entry["groups"]["rollout"]["assigned"] == relay.total


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    def run(seed: int) -> tuple[list[WorkerReading], list[dict[str, Any]]]:
        clock = ManualClock()
        backends = manual_backends("a", "b", clock=clock, seed=seed)
        relay = Relay(JOB, math_spec(rollout=2, iterations=2), backends)
        relay.launch("r0", "a", "rollout", [0])
        relay.launch("r1", "b", "rollout", [0])
        relay.launch("a0", "b", "actor", [1])
        samples = collect(relay, clock, 60, 0.2)
        return samples, [relay.entries[n] for n in sorted(relay.entries)]

    first, second, other = run(3), run(3), run(4)
    assert first == second
    assert first[0] != other[0]  # other response lengths: other tokens and timings


# --- migration steps ------------------------------------------------------------------------------


def rollout_host(clock: ManualClock, **kwargs: Any) -> tuple[SimBackend, Relay]:
    backend = manual_backends("a", clock=clock, **kwargs)["a"]
    relay = Relay(JOB, math_spec(rollout=2, prompts=16, samples=8, max_new_tokens=2048), {"a": backend})
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("r1", "a", "rollout", [1])
    relay.launch("a0", "a", "actor", [2])
    return backend, relay


def test_take_back_returns_partial_output_and_redistribute_resumes_it_with_fewer_tokens(
    clock: ManualClock,
) -> None:
    backend, relay = rollout_host(clock)
    relay.exchange()
    clock.advance(0.2)  # two virtual seconds of decoding
    relay.exchange()
    backend.execute_step(
        step("pause_workers", ["r1"], ["a/gpu1"], index=0, group="rollout", strategy="workload")
    )
    taken = backend.execute_step(
        step("take_back_requests", ["r1"], ["a/gpu1"], index=1, group="rollout", strategy="workload")
    )["requests"]
    assert taken, "the paused worker held unfinished requests"
    max_new = relay.spec["workload"]["max_new_tokens"]
    partial = [r for r in taken if r["generated_tokens"] > 0]
    assert partial
    host = backend.simulation
    records = host.jobs[JOB].model.records(0)
    for request in partial:
        record = records[request["episode"]]
        assert request["max_new_tokens"] == max_new - request["generated_tokens"]
        assert request["context_tokens"] == record.prompt_tokens + request["generated_tokens"]
    # Replaying the step (a new attempt of the same id) hands over the same requests.
    again = backend.execute_step(
        step(
            "take_back_requests", ["r1"], ["a/gpu1"], index=1, group="rollout", strategy="workload", attempt=2
        )
    )["requests"]
    assert again == taken

    placed = backend.execute_step(
        step(
            "redistribute_requests",
            ["r0"],
            ["a/gpu0"],
            index=2,
            group="rollout",
            strategy="workload",
            handover={"requests": taken},
        )
    )
    assert placed["placed"] == len(taken)
    with backend.lock:
        engine = host.workers["r0"].engine
        assert engine is not None
        resumed = {host.requests[r.rid].key[1]: r for r in [*engine.running.values(), *engine.local]}
        for request in partial:
            sim_request = resumed[request["episode"]]
            record = records[request["episode"]]
            assert sim_request.max_new == max_new - request["generated_tokens"]
            assert sim_request.generated == request["generated_tokens"]
            left = sim_request.remaining + (
                engine.steps - sim_request.start_step if sim_request.rid in engine.running else 0
            )
            assert left == record.response_tokens[0] - request["generated_tokens"]
    backend.execute_step(
        step("release_devices", ["r1"], ["a/gpu1"], index=3, group="rollout", strategy="workload")
    )
    assert backend.running_workers() == ["a0", "r0"]
    relay.placement.pop("r1")
    run_until(relay, clock, lambda: relay.iteration >= 1)
    # Every episode of the iteration completed exactly once, the handed-over ones on r0.
    assert relay.entries["a"]["groups"]["rollout"]["completed"] == relay.total


def test_a_rolled_back_take_back_returns_the_requests_to_the_resumed_worker(clock: ManualClock) -> None:
    backend, relay = rollout_host(clock)
    relay.exchange()
    clock.advance(0.2)
    relay.exchange()
    backend.execute_step(
        step("pause_workers", ["r1"], ["a/gpu1"], index=0, group="rollout", strategy="workload")
    )
    taken = backend.execute_step(
        step("take_back_requests", ["r1"], ["a/gpu1"], index=1, group="rollout", strategy="workload")
    )["requests"]
    assert backend.worker_state("r1") == "paused"
    returned = backend.execute_step(
        step(
            "return_requests",
            ["r1"],
            ["a/gpu1"],
            index=1,
            group="rollout",
            strategy="workload",
            handover={"requests": taken},
        )
    )
    assert returned["returned"] == len(taken)
    backend.execute_step(
        step("resume_workers", ["r1"], ["a/gpu1"], index=0, group="rollout", strategy="workload")
    )
    assert backend.worker_state("r1") == "running"
    run_until(relay, clock, lambda: relay.iteration >= 1)


def actor_host(clock: ManualClock, **kwargs: Any) -> tuple[SimBackend, Relay]:
    backend = manual_backends("a", clock=clock, **kwargs)["a"]
    relay = Relay(JOB, math_spec(rollout=1, actor=1), {"a": backend})
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("a0", "a", "actor", [1])
    relay.exchange()
    return backend, relay


GROW = ["a0", "actor-m7-1-w0"]


def grow_steps() -> list[dict[str, Any]]:
    return [
        step("reserve_devices", [], ["a/gpu2"], index=0),
        step("start_workers", ["actor-m7-1-w0"], ["a/gpu2"], index=1),
        step("transfer_state", ["actor-m7-1-w0"], ["a/gpu2"], index=2),
        step("rebuild_groups", GROW, ["a/gpu1", "a/gpu2"], index=3),
        step("barrier", GROW, ["a/gpu1", "a/gpu2"], index=4),
        step("switch", GROW, ["a/gpu1", "a/gpu2"], index=5),
        step("destroy_old", [], [], index=6),
    ]


def test_p2p_steps_change_the_trainer_membership_only_at_the_switch(clock: ManualClock) -> None:
    backend, _ = actor_host(clock)
    steps = grow_steps()
    for payload in steps[:5]:
        result = backend.execute_step(payload)
        assert backend.members(JOB, "actor") == ["a0"]
        if payload["step"]["kind"] == "transfer_state":
            # 1.5B params x 16 bytes of trainer state over the two GPUs after the move.
            assert result["shard_gb"] == pytest.approx(1.5 * 16 / 2)
    # Started, but unknown to the control plane until the switch: reconciliation must not see it.
    assert backend.worker_state("actor-m7-1-w0") == "running"
    assert "actor-m7-1-w0" not in backend.running_workers()
    backend.execute_step(steps[5])
    assert backend.members(JOB, "actor") == GROW
    assert "actor-m7-1-w0" in backend.running_workers()
    backend.execute_step(steps[6])
    assert backend.members(JOB, "actor") == GROW


def test_destroy_old_stops_leaving_ranks_on_a_host_that_took_no_part_in_the_switch(
    clock: ManualClock,
) -> None:
    backend, _ = actor_host(clock)  # a0 is this host's only rank; the gang shrank without it
    backend.execute_step(step("destroy_old", ["a0"], ["a/gpu1"], index=4))
    assert backend.worker_state("a0") == "stopped"
    assert backend.members(JOB, "actor") == []
    backend.execute_step(step("release_devices", ["a0"], ["a/gpu1"], index=5))
    assert "a0" not in backend.running_workers()


def test_a_barrier_before_the_state_arrived_fails(clock: ManualClock) -> None:
    backend, _ = actor_host(clock)
    steps = grow_steps()
    backend.execute_step(steps[0])
    backend.execute_step(steps[1])
    with pytest.raises(StepFailed, match="has not received the trainer state"):
        backend.execute_step(steps[4])
    backend.execute_step(step("destroy_new", ["actor-m7-1-w0"], ["a/gpu2"], index=1))
    backend.execute_step(step("release_reservation", [], ["a/gpu2"], index=0))
    assert backend.members(JOB, "actor") == ["a0"]
    assert backend.worker_state("actor-m7-1-w0") is None


def test_a_step_for_a_job_unknown_here_waits_for_its_spec(clock: ManualClock) -> None:
    backends = manual_backends("a", "b", clock=clock, spec_wait_s=10.0)
    relay = Relay(JOB, math_spec(rollout=1, actor=1), backends)
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("a0", "a", "actor", [1])
    outcome: dict[str, Any] = {}

    def start() -> None:
        outcome["result"] = backends["b"].execute_step(
            step("start_workers", ["actor-m7-1-w0"], ["b/gpu0"], index=1)
        )

    worker = threading.Thread(target=start)
    worker.start()
    time.sleep(0.2)
    assert worker.is_alive()  # waiting: b never ran this job
    reply = relay.reply("b")
    reply["jobs"][str(JOB)]["spec"] = relay.spec
    backends["b"].observe_control(reply)
    worker.join(timeout=10)
    assert outcome["result"]["started"] == ["actor-m7-1-w0"]


def test_a_registration_reply_teaches_the_specs_of_its_jobs(clock: ManualClock) -> None:
    backend = manual_backends("b", clock=clock, spec_wait_s=0.2)["b"]
    backend.observe_control({"created": False, "workers": [], "jobs": {str(JOB): math_spec()}})
    result = backend.execute_step(step("start_workers", ["actor-m7-1-w0"], ["b/gpu0"], index=1))
    assert result["started"] == ["actor-m7-1-w0"]


def test_without_a_spec_the_step_fails(clock: ManualClock) -> None:
    backend = manual_backends("b", clock=clock, spec_wait_s=0.2)["b"]
    with pytest.raises(StepFailed, match="unknown here"):
        backend.execute_step(step("start_workers", ["actor-m7-1-w0"], ["b/gpu0"], index=1))


# --- faults ----------------------------------------------------------------------------------------


def test_fail_raises_and_a_replay_of_the_same_attempt_repeats_the_outcome(clock: ManualClock) -> None:
    backend, _ = actor_host(clock, faults=["fail:switch"])
    for payload in grow_steps()[:5]:
        backend.execute_step(payload)
    with pytest.raises(StepFailed, match="injected fault fail:switch"):
        backend.execute_step(grow_steps()[5])
    assert backend.members(JOB, "actor") == ["a0"]  # the switch did not happen
    with pytest.raises(StepFailed, match="injected fault"):
        backend.execute_step(grow_steps()[5])


def test_a_fault_at_the_nth_occurrence_only(clock: ManualClock) -> None:
    backend, _ = actor_host(clock, faults="fail:health_check@2")
    check = [step("health_check", ["a0"], ["a/gpu1"], index=i, strategy="restart") for i in range(3)]
    backend.execute_step(check[0])
    with pytest.raises(StepFailed):
        backend.execute_step(check[1])
    backend.execute_step(check[2])


def test_faults_come_from_the_environment(clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNARL_SIM_FAULTS", "fail:drain, hang:barrier@3")
    backend = SimBackend("a", clock=clock)
    assert [str(f) for f in backend.faults.faults] == ["fail:drain", "hang:barrier@3"]
    with pytest.raises(StepFailed, match="fail:drain"):
        backend.execute_step(step("drain", [], [], group="reward", strategy="restart"))


def test_fault_specs_are_checked() -> None:
    for bad in ("explode:switch", "fail:teleport", "fail:switch@0", "switch"):
        with pytest.raises(FaultSpecError):
            parse_faults(bad)


def test_hang_blocks_until_the_backend_closes(clock: ManualClock) -> None:
    backend, _ = actor_host(clock, faults=["hang:barrier"])
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            backend.execute_step(step("barrier", ["a0"], ["a/gpu1"], index=4))
        except StepFailed as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=0.3)
    assert worker.is_alive()
    backend.close()
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert "hang:barrier" in str(outcome["error"])


CRASHING_AGENT = """
import sys
from agents.backends.sim.backend import SimBackend
from tests.sim_backend.test_backend import grow_steps
from tests.sim_backend.relay import Relay, math_spec
backend = SimBackend("a", speed=1000.0, faults="crash:transfer_state")
relay = Relay(7, math_spec(rollout=1, actor=1), {"a": backend})
relay.launch("a0", "a", "actor", [1])
for payload in grow_steps()[:3]:
    print("executing", payload["step"]["kind"], flush=True)
    backend.execute_step(payload)
print("survived", flush=True)
"""


def test_crash_kills_the_agent_process_mid_step() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("DYNARL_SIM_FAULTS", None)
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_AGENT], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 70, done.stderr
    assert "executing transfer_state" in done.stdout
    assert "survived" not in done.stdout


def test_in_wall_clock_time_a_background_thread_keeps_the_simulation_going() -> None:
    started = time.time()
    backend = SimBackend("a", speed=100.0, faults=[], sample_interval_s=0.05)
    try:
        relay = Relay(JOB, math_spec(rollout=1, actor=1), {"a": backend})
        assert relay.launch("r0", "a", "rollout", [0])["ok"]
        backend.observe_control(relay.reply("a"))
        deadline = time.time() + 30
        samples: list[WorkerReading] = []
        while time.time() < deadline and not any(s.tokens for s in samples):
            time.sleep(0.05)
            samples.extend(backend.telemetry().workers)
        assert any(s.tokens > 0 for s in samples)
        assert all(started <= s.at <= time.time() for s in samples)
        assert backend.virtual_now() > 0
    finally:
        backend.close()


def test_a_grown_rollout_sheds_its_queue_to_the_new_engine_and_finishes_every_episode_once(
    clock: ManualClock,
) -> None:
    """The iteration's batch went out to one engine; an engine that joins later gets work only
    because the old one sheds a share of its queue (what the plan's shed/redistribute steps do)."""
    backend = manual_backends("a", clock=clock)["a"]
    relay = Relay(JOB, math_spec(rollout=1, prompts=128, samples=8, max_new_tokens=2048), {"a": backend})
    relay.launch("r0", "a", "rollout", [0])
    relay.launch("a0", "a", "actor", [2])
    relay.exchange()
    clock.advance(0.2)
    relay.exchange()
    host = backend.simulation
    with backend.lock:
        old = host.workers["r0"].engine
        assert old is not None
        queued_before = len(old.local)
    assert queued_before > 256, "the one engine holds the whole batch, most of it queued"
    relay.launch("r1", "a", "rollout", [1])  # started, checked and switched in
    relay.exchange()
    shed = step(
        "shed_requests", ["r0"], ["a/gpu0"], index=6, group="rollout", strategy="workload", migration="m7-2"
    )
    shed["step"]["share"] = 0.5
    with backend.lock:
        queued_now = len(old.local)
    taken = backend.execute_step(shed)["requests"]
    assert len(taken) == queued_now // 2 > 0
    assert all(r["generated_tokens"] == 0 and r["from"] == "r0" for r in taken), "only queued work moves"
    # Another attempt of the same step hands over the same requests and sheds nothing more.
    shed["attempt"] = 2
    assert backend.execute_step(shed)["requests"] == taken
    placed = backend.execute_step(
        step(
            "redistribute_requests",
            ["r1"],
            ["a/gpu1"],
            index=7,
            group="rollout",
            strategy="workload",
            handover={"requests": taken},
            migration="m7-2",
        )
    )
    assert placed == {"placed": len(taken), "workers": {"r1": len(taken)}}
    with backend.lock:
        new = host.workers["r1"].engine
        assert new is not None
        assert len(old.local) + len(old.running) >= len(taken)
        assert len(new.local) + len(new.running) == len(taken)
    run_until(relay, clock, lambda: relay.iteration >= 1)
    assert relay.entries["a"]["groups"]["rollout"]["completed"] == relay.total


def test_a_shed_share_outside_zero_to_one_is_refused(clock: ManualClock) -> None:
    backend, relay = rollout_host(clock)
    relay.exchange()
    shed = step("shed_requests", ["r0"], ["a/gpu0"], index=6, group="rollout", strategy="workload")
    shed["step"]["share"] = 1.5
    with pytest.raises(StepFailed, match="share"):
        backend.execute_step(shed)
