"""The job driver: one detached actor per job that runs the RL loop over the job's workers.

Agents place workers; the driver makes them one job. Every agent that launches workers of a job
asks for the driver by name with ``get_if_exists`` (``ensure_driver``), so exactly one exists,
wherever the first launch happened. The agents hand it the control plane's picture of the job from
each heartbeat reply (``observe``): the iteration the control plane has opened and each group's
live members. The driver then:

1. waits until every group has members and each member's actor answers;
2. sets the job up: the warm-start weights (a supervised warm start, kept in the checkpoint
   directory under a key of the model, task and seed, so a later job or a restarted driver reuses
   it); the engines load them through SGLang's ``/update_weights_from_disk``; the trainer's ranks
   (the ``actor`` group's members in name order) join one data-parallel group through rank 0's TCP
   store, and rank 0 opens the weight-update group of the rollout engines;
3. runs iteration ``k`` once the control plane has opened it, so that the scheduler's decisions
   at an iteration boundary come before the next iteration's work (``runtime.rl.loop``): generate
   on the rollout engines, score on the reward workers, reference log-probs on the inference
   engines when the KL term is on, one GRPO step on every trainer rank, then the new weights go to
   every rollout engine, which must report the trainer's weight version before the iteration ends.

``progress()`` says what it did: the iteration it works on and the last one trained, per worker
the samples of the current iteration, each iteration's report, and a failure. Any error (a worker
actor that died, an engine that answered wrongly) ends the loop with a failure the agents report;
the control plane then fails the job with that reason.
"""

from __future__ import annotations

import json
import logging
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agents.backends.ray.actors import kill_actor
from agents.backends.ray.connection import RayNode
from runtime.engine.client import EngineClient, EngineError
from runtime.model.config import GPTConfig
from runtime.rl.grpo import GRPOConfig, Trajectory
from runtime.rl.job import INITIAL_WEIGHT_VERSION, RLJobConfig, warm_start_checkpoint, warm_start_weights
from runtime.rl.loop import EngineReference, IterationReport, run_iteration
from runtime.rl.trainer import TrainStepMetrics
from runtime.task.arithmetic import Problem, TaskConfig
from runtime.task.tokenizer import CharTokenizer

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S: Final = 600.0
STEP_TIMEOUT_S: Final = 1800.0
CALL_TIMEOUT_S: Final = 2.0
DRIVER_PREFIX: Final = "dynarl-job-"
RESULTS_SENT: Final = 8  # the latest iteration results each heartbeat repeats (kept once by iteration)
ENGINE_MAX_RUNNING: Final = 64
# The runtime's own settings, not the spec's: the asymmetric clip of DAPO (more room to raise a
# good token's probability than to lower it) and a short warm-start warmup, as tuned in
# tests/runtime/rl/test_loop.py.
CLIP_LOW: Final = 0.2
CLIP_HIGH: Final = 0.28
WARM_START_WARMUP_STEPS: Final = 10


def driver_name(job_id: int) -> str:
    return f"{DRIVER_PREFIX}{job_id}"


def rl_config(spec: Mapping[str, Any]) -> RLJobConfig:
    """The RL job a stored spec (``JobSpec.to_json()``) describes; ValueError when the ray runtime
    cannot run it (the spec parser refuses those already; this guards the backend's own door)."""
    runtime = spec.get("runtime")
    workload = spec.get("workload")
    if not isinstance(runtime, Mapping) or not isinstance(workload, Mapping):
        raise ValueError("the spec has no runtime section (the model, task and training a real job runs)")
    if workload.get("kind") != "math":
        raise ValueError(f"the ray runtime runs math workloads, not {workload.get('kind')!r}")
    try:
        return RLJobConfig(
            model=GPTConfig(vocab_size=CharTokenizer().vocab_size, **runtime["model"]),
            task=TaskConfig(
                max_digits=int(runtime["task"]["max_digits"]),
                zipf_exponent=float(runtime["task"]["zipf_exponent"]),
            ),
            seed=int(runtime["seed"]),
            iterations=int(workload["iterations"]),
            prompts_per_iteration=int(workload["prompts_per_iteration"]),
            group_size=int(workload["samples_per_prompt"]),
            max_new_tokens=int(workload["max_new_tokens"]),
            temperature=float(runtime["temperature"]),
            learning_rate=float(runtime["learning_rate"]),
            micro_batch_size=int(runtime["micro_batch_size"]),
            grpo=GRPOConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, kl_coef=float(runtime["kl_coef"])),
            dataset_size=None if runtime.get("dataset_size") is None else int(runtime["dataset_size"]),
            warm_start_steps=int(runtime["warm_start_steps"]),
            warm_start_warmup_steps=WARM_START_WARMUP_STEPS,
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the spec's runtime section is incomplete: {exc}") from exc


def requested_engine(spec: Mapping[str, Any]) -> str:
    """The spec's ``runtime.engine`` (``auto`` for specs stored before it existed)."""
    runtime = spec.get("runtime")
    return str(runtime.get("engine", "auto")) if isinstance(runtime, Mapping) else "auto"


def engine_settings(config: RLJobConfig) -> dict[str, Any]:
    """A job's engine settings as a launch passes them to the actor (plain values)."""
    return dict(vars(config.engine_settings(max_running_requests=ENGINE_MAX_RUNNING)))


# -- the agents' side ---------------------------------------------------------------------------


def ensure_driver(job_id: int, spec: Mapping[str, Any], node: RayNode, checkpoint_dir: str) -> Any:
    """The job's driver, started near ``node`` unless another agent started it first."""
    return (
        ray.remote(JobDriver)
        .options(
            name=driver_name(job_id),
            get_if_exists=True,
            lifetime="detached",
            max_restarts=0,  # a driver that died has lost the job's loop: the job fails
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=True),
        )
        .remote(job_id, dict(spec), checkpoint_dir)
    )


def driver_handle(job_id: int) -> Any | None:
    try:
        return ray.get_actor(driver_name(job_id))
    except ValueError:
        return None


def job_actors(job_id: int) -> list[str]:
    """Names of the job's worker actors alive anywhere in the cluster (``<node>/j<job>-...``)."""
    marker = f"/j{job_id}-"
    return [name for name in ray.util.list_named_actors() if marker in name]


def stop_driver(job_id: int, *, timeout_s: float = 30.0) -> None:
    handle = driver_handle(job_id)
    if handle is not None:
        kill_actor(handle, driver_name(job_id), timeout_s=timeout_s)


def observe(job_id: int, view: Mapping[str, Any]) -> None:
    """Hand the control plane's picture of the job to its driver (not waited for)."""
    handle = driver_handle(job_id)
    if handle is not None:
        handle.observe.remote(dict(view))


def driver_progress(job_id: int) -> dict[str, Any] | None:
    """The driver's progress, or None when it does not answer in time. A driver that is gone
    (died, or killed) answers ``{"failure": ...}``."""
    handle = driver_handle(job_id)
    if handle is None:
        return {"failure": f"the job's driver ({driver_name(job_id)}) is gone"}
    try:
        progress: dict[str, Any] = ray.get(handle.progress.remote(), timeout=CALL_TIMEOUT_S)
    except GetTimeoutError:
        return None
    except RayActorError as exc:
        return {"failure": f"the job's driver ({driver_name(job_id)}) died: {exc}"}
    return progress


def progress_entry(
    job_id: int, progress: Mapping[str, Any] | None, mine: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """This node's heartbeat entry for the job: its workers' part of the current iteration (the
    rollout's samples are summed over nodes by the control plane, the trainer's are the gang's),
    the trained iteration, the latest results and a failure."""
    progress = progress or {}
    iteration = int(progress.get("iteration", 0))
    trained = progress.get("trained_iteration")
    groups: dict[str, dict[str, int]] = {}
    per_worker: Mapping[str, Sequence[int]] = progress.get("samples", {})
    for payload in mine:
        group = str(payload.get("group"))
        done, assigned = per_worker.get(str(payload.get("worker")), (0, 0))
        counts = groups.setdefault(group, {"completed": 0, "assigned": 0})
        if payload.get("kind") == "actor":
            trained_samples = int(progress.get("trained_samples", 0))
            counts.update(completed=trained_samples, assigned=int(progress.get("batch", 0)))
        else:
            counts["completed"] += int(done)
            counts["assigned"] += int(assigned)
    entry: dict[str, Any] = {
        "job": job_id,
        "iteration": iteration,
        "groups": groups,
        "trained_iteration": trained if isinstance(trained, int) and trained <= iteration else None,
    }
    results = progress.get("results", [])
    if results:
        entry["results"] = list(results[-RESULTS_SENT:])
    if progress.get("failure"):
        entry["failure"] = str(progress["failure"])[:2000]
    return entry


# -- the driver ---------------------------------------------------------------------------------


class JobFailed(RuntimeError):
    """The job cannot go on; the message is what the operator reads."""


@dataclass
class _View:
    """The control plane's latest picture of the job, as far as the driver needs it."""

    iteration: int = 0
    state: str = ""
    members: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)  # group -> (kind, workers)


class RayTrainerGroup:
    """The trainer's data-parallel ranks as the loop drives them: every rank takes the global
    batch and the same step; rank 0 pushes the weights."""

    def __init__(self, ranks: Sequence[Any]) -> None:
        self.ranks = list(ranks)

    def train_step(self, trajectories: Sequence[Trajectory]) -> TrainStepMetrics:
        batch = ray.put(list(trajectories))
        metrics: list[TrainStepMetrics] = ray.get(
            [rank.train_step.remote(batch) for rank in self.ranks], timeout=STEP_TIMEOUT_S
        )
        return metrics[0]

    def push_weights(self) -> str:
        return str(ray.get(self.ranks[0].push_weights.remote(), timeout=STEP_TIMEOUT_S))


class RayReward:
    """The reward workers: the samples split evenly over them, scored in parallel."""

    def __init__(self, workers: Sequence[Any]) -> None:
        self.workers = list(workers)

    def score(self, problems_and_texts: Sequence[tuple[Problem, str]]) -> list[float]:
        count = len(self.workers)
        share = -(-len(problems_and_texts) // count)
        chunks = [problems_and_texts[i * share : (i + 1) * share] for i in range(count)]
        futures = [
            worker.score.remote([p for p, _ in chunk], [t for _, t in chunk])
            for worker, chunk in zip(self.workers, chunks, strict=True)
            if chunk
        ]
        scored: list[list[float]] = ray.get(futures, timeout=STEP_TIMEOUT_S)
        return [value for chunk in scored for value in chunk]


class JobDriver:
    """The actor (see the module's docstring). Its loop runs in a thread of its own; ``observe``
    and ``progress`` answer at once."""

    def __init__(self, job_id: int, spec: Mapping[str, Any], checkpoint_dir: str) -> None:
        torch.set_num_threads(1)
        self.job_id = job_id
        self.config = rl_config(spec)
        self.groups = sorted(str(c["name"]) for c in spec.get("components", []))
        self.checkpoint_dir = Path(checkpoint_dir)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._view: _View | None = None
        self._stopping = False
        self._phase = "waiting for workers"
        self._iteration = 0
        self._trained: int | None = None
        self._trained_samples = 0
        self._samples: dict[str, tuple[int, int]] = {}
        self._results: list[dict[str, Any]] = []
        self._failure: str | None = None
        self._workers: dict[str, Any] = {}  # member worker -> its actor, once found
        self._thread = threading.Thread(target=self._run, name=f"job-{job_id}-driver", daemon=True)
        self._thread.start()

    # -- what the agents call --------------------------------------------------------------------

    def observe(self, view: Mapping[str, Any]) -> None:
        groups = view.get("groups", {})
        members = {
            str(name): (str(group.get("kind")), tuple(str(w) for w in group.get("workers", [])))
            for name, group in (groups.items() if isinstance(groups, Mapping) else [])
            if isinstance(group, Mapping)
        }
        with self._changed:
            self._view = _View(
                iteration=int(view.get("iteration", 0)), state=str(view.get("state", "")), members=members
            )
            self._changed.notify_all()

    def progress(self) -> dict[str, Any]:
        with self._lock:
            return {
                "phase": self._phase,
                "iteration": self._iteration,
                "trained_iteration": self._trained,
                "trained_samples": self._trained_samples,
                "batch": self.config.global_batch_size,
                "samples": dict(self._samples),
                "results": list(self._results),
                "failure": self._failure,
            }

    def shutdown(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    # -- the loop ---------------------------------------------------------------------------------

    def _set(self, **values: Any) -> None:
        with self._lock:
            for name, value in values.items():
                setattr(self, f"_{name}", value)

    def _wait_for(self, ready: Callable[[_View], bool], timeout_s: float | None = None) -> _View:
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._stopping or (self._view is not None and ready(self._view)), timeout=timeout_s
            ):
                raise JobFailed(f"the job's workers did not all appear within {timeout_s:g} s")
            if self._stopping:
                raise JobFailed("the driver was shut down")
            assert self._view is not None
            return self._view

    def _run(self) -> None:
        try:
            self._loop()
        except JobFailed as exc:
            self._fail(str(exc))
        except RayActorError as exc:
            self._fail(f"a call to one of its workers failed: {_first_line(exc)}")
        except (RayError, EngineError, OSError, ValueError, RuntimeError) as exc:
            log.exception("job %s: the driver's loop failed", self.job_id)
            self._fail(f"{type(exc).__name__}: {_first_line(exc)}")
        except Exception as exc:  # the loop must end in a reported failure, never silently
            log.error("job %s: %s", self.job_id, traceback.format_exc())
            self._fail(f"{type(exc).__name__}: {_first_line(exc)}")

    def _fail(self, why: str) -> None:
        # The error a call raised rarely names the worker behind it (an engine's HTTP error names
        # a URL); the operator is told which of the job's workers are gone.
        dead = self._dead_workers()
        if dead:
            why = f"worker {', '.join(dead)} died ({why})"
        with self._lock:
            if not self._stopping:
                self._failure = why
                self._phase = "failed"

    def _dead_workers(self) -> list[str]:
        """The job's workers whose actors are gone, asked of all at once."""
        pings = {handle.__ray_ready__.remote(): name for name, handle in self._workers.items()}
        if not pings:
            return []
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=CALL_TIMEOUT_S)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                dead.append(pings[ref])
        return sorted(dead)

    def _loop(self) -> None:
        view = self._wait_for(
            lambda v: all(v.members.get(g, ("", ()))[1] for g in self.groups), timeout_s=SETUP_TIMEOUT_S
        )
        workers = self._workers = self._resolve(view)
        self._set(phase="setting up")
        engines, reference, reward, trainer = self._setup(view, workers)
        self._set(phase="ready")
        for iteration in range(self.config.iterations):
            # The control plane opens iteration k once every trainer node reported k - 1 trained.
            view = self._wait_for(opened(iteration))
            if view.iteration > iteration:
                continue  # opened past (a driver restarted mid-job): already trained
            self._set(phase="generating", iteration=iteration, samples={}, trained_samples=0)
            report = run_iteration(
                self.config, f"j{self.job_id}", iteration, engines, reward, reference, trainer
            )
            self._record(report, view)

    def _resolve(self, view: _View) -> dict[str, Any]:
        """Each member's actor handle, by worker name (actors are named ``<node>/<worker>``)."""
        names = {name.rpartition("/")[2]: name for name in ray.util.list_named_actors()}
        handles = {}
        for _, workers in view.members.values():
            for worker in workers:
                if worker not in names:
                    raise JobFailed(f"worker {worker} has no actor in the Ray cluster")
                handles[worker] = ray.get_actor(names[worker])
        return handles

    def _setup(
        self, view: _View, workers: Mapping[str, Any]
    ) -> tuple[list[EngineClient], EngineReference | None, RayReward, RayTrainerGroup]:
        def of_kind(kind: str) -> list[str]:
            return sorted(w for k, members in view.members.values() if k == kind for w in members)

        rollout_names, inference_names = of_kind("rollout"), of_kind("inference")
        actor_names, reward_names = of_kind("actor"), of_kind("reward")
        urls = dict(
            zip(
                rollout_names + inference_names,
                ray.get(
                    [workers[w].url.remote() for w in rollout_names + inference_names],
                    timeout=SETUP_TIMEOUT_S,
                ),
                strict=True,
            )
        )
        weights = warm_start_weights(self.config, self.checkpoint_dir)
        checkpoint = warm_start_checkpoint(self.config, self.checkpoint_dir)
        clients = {name: EngineClient(url) for name, url in urls.items()}
        for name, client in clients.items():
            result = client.update_weights_from_disk(str(checkpoint), weight_version=INITIAL_WEIGHT_VERSION)
            if not result.success:
                raise JobFailed(f"engine {name} could not load the warm-start weights: {result.message}")
        initial = ray.put(weights)
        ranks = [workers[name] for name in actor_names]
        store = ray.get(ranks[0].host_store.remote(len(ranks)), timeout=SETUP_TIMEOUT_S)
        ray.get(
            [rank.join.remote(store, i, len(ranks), "dp-0", initial) for i, rank in enumerate(ranks)],
            timeout=SETUP_TIMEOUT_S,
        )
        ray.get(ranks[0].connect_engines.remote([urls[n] for n in rollout_names]), timeout=SETUP_TIMEOUT_S)
        reference = EngineReference([clients[n] for n in inference_names]) if inference_names else None
        reward = RayReward([workers[n] for n in reward_names])
        return [clients[n] for n in rollout_names], reference, reward, RayTrainerGroup(ranks)

    def _record(self, report: IterationReport, view: _View) -> None:
        rollout = sorted(w for k, members in view.members.values() if k == "rollout" for w in members)
        per_engine = dict(zip(rollout, report.samples_per_engine, strict=False))
        result = report_result(report)
        with self._lock:
            self._samples = {name: (count, count) for name, count in per_engine.items()}
            self._trained = report.iteration
            self._trained_samples = report.samples
            self._results.append(result)
            self._phase = "trained"


def opened(iteration: int) -> Callable[[_View], bool]:
    """Whether the control plane has opened ``iteration`` (or a later one)."""

    def check(view: _View) -> bool:
        return view.iteration >= iteration

    return check


def report_result(report: IterationReport) -> dict[str, Any]:
    """An iteration's report as the heartbeat carries it (plain JSON)."""
    return dict(json.loads(report.to_json()))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
