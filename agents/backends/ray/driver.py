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
   on the rollout engines (an agentic job's multi-turn episodes through its DataRouter, calling
   the tool workers' calculator: ``runtime.rl.agentic``), score on the reward workers, reference log-probs on the inference
   engines when the KL term is on, one GRPO step on every trainer rank, then the new weights go to
   every rollout engine, which must report the trainer's weight version before the iteration ends.

What an agent calls to start, find and ask the driver is ``agents.backends.ray.driver_client``'s.

``progress()`` says what it did: the iteration it works on and the last one trained, per worker
the samples of the current iteration, each iteration's report, and a failure. Any error (a worker
actor that died, an engine that answered wrongly) ends the loop with a failure the agents report;
the control plane then fails the job with that reason.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import ray
import torch
from ray.exceptions import RayActorError, RayError

from agents.backends.once import OncePerKey
from agents.backends.ray.actors import ENGINE_KINDS
from agents.backends.ray.driver_client import (
    CALL_TIMEOUT_S,
    ENGINE_MAX_RUNNING,
    P2P_KINDS,
    RESTARTED_KINDS,
    WORKLOAD_KINDS,
    engine_settings,
    requested_engine,
    rl_config,
)
from runtime.engine.client import EngineClient, EngineError
from runtime.rl.agentic import AgenticSettings, AgentLoop
from runtime.rl.grpo import Trajectory
from runtime.rl.job import INITIAL_WEIGHT_VERSION
from runtime.rl.loop import EngineReference, IterationReport, run_iteration
from runtime.rl.rollout import EnginePool
from runtime.rl.trainer import TrainStepMetrics
from runtime.rl.trainer_config import TrainerConfig
from runtime.rl.warm_start import warm_start_checkpoint, warm_start_weights
from runtime.task.arithmetic import Problem
from runtime.task.calculator import ToolCallError

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S: Final = 600.0
STEP_TIMEOUT_S: Final = 1800.0
# The longest a p2p migration may hold the trainer (transfer to switch) before the job fails:
# a migration abandoned without its compensations must not stall the job for good.
GATE_TIMEOUT_S: Final = 900.0
# How long keeping the trainer's state for a re-placement waits for a train step or weight push
# under way to end.
KEEP_STATE_TIMEOUT_S: Final = 120.0
# -- the driver ---------------------------------------------------------------------------------


class JobFailed(RuntimeError):
    """The job cannot go on; the message is what the operator reads."""


@dataclass
class _View:
    """The control plane's latest picture of the job, as far as the driver needs it."""

    iteration: int = 0
    state: str = ""
    members: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)  # group -> (kind, workers)


class TrainingGate:
    """Keeps a p2p migration and the trainer's work apart: while a migration holds the gate (from
    its transfer to its switch or rollback) no train step or weight push starts, and a migration
    takes the gate only between them, so the state it moves is one step's, whole."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._holder: str | None = None
        self._busy = 0

    def hold(self, migration: str, timeout_s: float) -> None:
        with self._changed:
            if self._holder == migration:
                return
            if not self._changed.wait_for(lambda: self._holder is None and not self._busy, timeout=timeout_s):
                raise TimeoutError(f"the trainer stayed busy (or held by {self._holder}) for {timeout_s:g} s")
            self._holder = migration

    def release(self, migration: str) -> None:
        with self._changed:
            if self._holder == migration:
                self._holder = None
                self._changed.notify_all()

    @property
    def holder(self) -> str | None:
        with self._changed:
            return self._holder

    @contextmanager
    def work(self, timeout_s: float) -> Iterator[None]:
        with self._changed:
            if not self._changed.wait_for(lambda: self._holder is None, timeout=timeout_s):
                raise JobFailed(f"migration {self._holder} held the trainer for over {timeout_s:g} s")
            self._busy += 1
        try:
            yield
        finally:
            with self._changed:
                self._busy -= 1
                self._changed.notify_all()


class RayTrainerGroup:
    """The trainer's data-parallel ranks as the loop drives them: every rank takes the global
    batch and the same steps; rank 0 pushes the weights. A p2p migration's switch replaces
    ``ranks``, and a re-placement keeps the trainer's state, under the gate: never in the middle
    of an iteration's steps."""

    def __init__(self, ranks: Sequence[Any], gate: TrainingGate | None = None) -> None:
        self.ranks = list(ranks)
        self.gate = gate or TrainingGate()

    def train(self, trajectories: Sequence[Trajectory], epochs: int) -> list[TrainStepMetrics]:
        batch = ray.put(list(trajectories))
        steps: list[TrainStepMetrics] = []
        with self.gate.work(GATE_TIMEOUT_S):
            for _ in range(epochs):
                metrics: list[TrainStepMetrics] = ray.get(
                    [rank.train_step.remote(batch) for rank in self.ranks], timeout=STEP_TIMEOUT_S
                )
                steps.append(metrics[0])
        return steps

    def push_weights(self) -> str:
        with self.gate.work(GATE_TIMEOUT_S):
            return str(ray.get(self.ranks[0].push_weights.remote(), timeout=STEP_TIMEOUT_S))


class RayWorkerGroup:
    """Workers that work in calls (the reward's, the tools'), and which of them are in service.

    A ``restart`` migration changes the membership: a worker being drained gets no new call
    (``drain`` returns once its calls in flight ended), and a switch sets the members."""

    role = "worker"

    def __init__(self, workers: Mapping[str, Any]) -> None:
        self._changed = threading.Condition()
        self._members = dict(workers)
        self._draining: set[str] = set()
        self._busy: dict[str, int] = {}

    @property
    def members(self) -> list[str]:
        with self._changed:
            return sorted(self._members)

    @contextmanager
    def _calling(self, pick: Callable[[list[tuple[str, Any]]], list[tuple[str, Any]]]) -> Iterator[list[Any]]:
        """The handles ``pick`` chooses among the workers in service, counted busy meanwhile."""
        with self._changed:
            active = [(n, h) for n, h in sorted(self._members.items()) if n not in self._draining]
            if not active:
                raise JobFailed(f"the job has no {self.role} worker in service")
            chosen = pick(active)
            for name, _ in chosen:
                self._busy[name] = self._busy.get(name, 0) + 1
        try:
            yield [handle for _, handle in chosen]
        finally:
            with self._changed:
                for name, _ in chosen:
                    self._busy[name] -= 1
                self._changed.notify_all()

    def _least_busy(self, active: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return [min(active, key=lambda item: self._busy.get(item[0], 0))]

    def drain(self, workers: Sequence[str], timeout_s: float) -> None:
        with self._changed:
            self._draining |= set(workers)
            if not self._changed.wait_for(
                lambda: not any(self._busy.get(w) for w in workers), timeout=timeout_s
            ):
                raise TimeoutError(f"{', '.join(workers)} still working after {timeout_s:g} s")

    def undrain(self, handles: Mapping[str, Any]) -> None:
        """Back in service, with their handles (an actor restarted by its agent is a new one)."""
        with self._changed:
            self._draining -= set(handles)
            self._members.update(handles)
            self._changed.notify_all()

    def set_members(self, handles: Mapping[str, Any]) -> None:
        with self._changed:
            self._members = dict(handles)
            self._draining &= set(handles)
            self._changed.notify_all()


class RayReward(RayWorkerGroup):
    """The reward workers: the samples split evenly over those in service, scored in parallel."""

    role = "reward"

    def score(self, problems_and_texts: Sequence[tuple[Problem, str]]) -> list[float]:
        with self._calling(lambda active: active) as handles:
            share = -(-len(problems_and_texts) // len(handles))
            chunks = [problems_and_texts[i * share : (i + 1) * share] for i in range(len(handles))]
            futures = [
                handle.score.remote([p for p, _ in chunk], [t for _, t in chunk])
                for handle, chunk in zip(handles, chunks, strict=True)
                if chunk
            ]
            scored: list[list[float]] = ray.get(futures, timeout=STEP_TIMEOUT_S)
        return [value for chunk in scored for value in chunk]


class RayTools(RayWorkerGroup):
    """The tool workers as the agentic rollout calls them (`runtime.rl.agentic.ToolCaller`):
    each call goes to the one in service with the fewest calls in flight."""

    role = "tool"

    def call(self, expression: str) -> str:
        with self._calling(self._least_busy) as (handle,):
            answer: str | None = ray.get(handle.call.remote(expression), timeout=STEP_TIMEOUT_S)
        if answer is None:
            raise ToolCallError(f"the calculator refuses {expression!r}")
        return answer


class JobDriver:
    """The actor (see the module's docstring). Its loop runs in a thread of its own; ``observe``
    and ``progress`` answer at once."""

    def __init__(self, job_id: int, spec: Mapping[str, Any], checkpoint_dir: str) -> None:
        torch.set_num_threads(1)
        self.job_id = job_id
        self.config = rl_config(spec)
        self.groups = sorted(str(c["name"]) for c in spec.get("components", []))
        self.kinds = {str(c["name"]): str(c.get("kind", "")) for c in spec.get("components", [])}
        self.engine = requested_engine(spec)
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
        self._loop_ended = False
        self._trained_version: str | None = None  # the trainer's weight version after _trained
        self._kept = OncePerKey()  # keep_state's outcome, by the iteration redone
        self._workers: dict[str, Any] = {}  # member worker -> its actor, once found
        # The trainer as the loop drives it, its ranks' workers in rank order, and the rollout
        # engines' URLs (a new rank 0 opens the weight push to them): set up by the loop.
        self._trainer = RayTrainerGroup([])
        self._ranks: list[str] = []
        self._rollout_urls: list[str] = []
        self._reward = RayReward({})
        self._tools = RayTools({})
        # An agentic job's episodes, dispatched through its DataRouter, call the tool workers.
        self._agent = (
            AgentLoop(self._tools, AgenticSettings.for_job(self.config, ENGINE_MAX_RUNNING))
            if self.config.task.calculator
            else None
        )
        self._pool: EnginePool | None = None  # the rollout engines, once set up
        self._reference_pool: EnginePool | None = None  # the inference engines, if the job has any
        self._ready = threading.Event()
        self._p2p = P2pMigration(self)
        self._restart = RestartMigration(self)
        self._workload = WorkloadMigration(self)
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

    def trainer_config(self) -> TrainerConfig:
        """What a new trainer rank of this job is built with (a p2p migration's start_workers)."""
        return self.config.trainer_config()

    def tool_latency(self) -> float:
        """What a new tool worker of this job is started with (a restart's start_workers)."""
        return self.config.tool_latency_s

    def group_kind(self, group: str) -> str:
        """The component kind of one of the job's groups (what a migration's new workers are)."""
        return self.kinds.get(group, "")

    def migration_step(self, step: Mapping[str, Any]) -> dict[str, Any]:
        """Carry out the job-wide part of a migration step (``strategy``, ``kind``, ``step_id``,
        ``attempt``, ``worker_ids``): the trainer's p2p steps, a restart's drain and switch.
        Every node of the step asks; the first call does the work and the others get its
        outcome. Raises with a readable reason on failure."""
        if step.get("strategy") == "restart":
            return self._restart.step(step)
        if step.get("strategy") == "workload":
            return self._workload.step(step)
        return self._p2p.step(step)

    def engine_launch(self) -> tuple[str, dict[str, Any], str]:
        """What a new rollout engine of this job is started with: the model, the engine settings
        and the spec's engine choice (a workload migration's start_workers)."""
        return self.config.model.to_json(), engine_settings(self.config), self.engine

    def shutdown(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def keep_state(self, redo_from_iteration: int) -> dict[str, Any]:
        """Before the job is placed anew (every worker stops; the new layout's driver redoes
        ``redo_from_iteration``): write the trainer's state after the iteration before it where
        the new driver reads it (``state_path``), or after that iteration itself when the trainer
        had trained it by the time the stop came (an iteration's steps can end well within the
        control plane's round trip): the new driver then takes it as trained and reports its
        result again. From here on this driver's trainer takes no step and its loop's failures
        are not the job's: its workers are about to stop. Every node asks before it stops its
        workers; the first call does the work, the others get its outcome. Returns ``kept`` and,
        when nothing was kept, why: the new driver then refuses to resume rather than start
        over from the warm start."""
        return self._kept.run(redo_from_iteration, lambda: self._keep(redo_from_iteration), failures=())

    def state_path(self) -> Path:
        """Where the job's trainer state is kept across a re-placement (on storage every node of
        the job reads)."""
        return self.checkpoint_dir / f"job-{self.job_id}" / "trainer-state.pt"

    def _keep(self, redo_from_iteration: int) -> dict[str, Any]:
        self.shutdown()
        nothing_yet = {
            "kept": False,
            "why": "nothing was trained yet: the new trainer starts from the warm start",
        }
        if not self._trainer.ranks:
            if redo_from_iteration == 0:
                self.state_path().unlink(missing_ok=True)
                return nothing_yet
            return {"kept": False, "why": "the trainer was not set up"}
        rank0 = self._trainer.ranks[0]
        try:
            # Wait for an iteration's steps or a push under way to end, and let no other begin.
            self._trainer.gate.hold("re-placement", KEEP_STATE_TIMEOUT_S)
            current = str(ray.get(rank0.weight_version.remote(), timeout=KEEP_STATE_TIMEOUT_S))
            if current != self._recorded_version():
                # An iteration's steps ended and its push or check has not: let the loop finish
                # it (nothing new starts: the driver is shut down), then keep the state after it.
                self._trainer.gate.release("re-placement")
                self._await_recorded(current, KEEP_STATE_TIMEOUT_S)
                self._trainer.gate.hold("re-placement", KEEP_STATE_TIMEOUT_S)
        except TimeoutError as exc:
            return {"kept": False, "why": str(exc)}
        except RayError as exc:
            return {"kept": False, "why": f"the trainer's rank 0 did not answer: {_first_line(exc)}"}
        with self._lock:
            version, trained = self._trained_version, self._trained
            result = next((r for r in reversed(self._results) if r.get("iteration") == trained), None)
        if trained is None and redo_from_iteration == 0:
            self.state_path().unlink(missing_ok=True)
            return nothing_yet
        try:
            if trained not in (redo_from_iteration - 1, redo_from_iteration) or current != version:
                return {
                    "kept": False,
                    "why": f"the trainer is at weight version {current} (iteration {trained} trained), not "
                    f"the state after iteration {redo_from_iteration - 1} or {redo_from_iteration} that the "
                    f"new layout goes on from",
                }
            cursor: dict[str, Any] = {"trained_iteration": trained, "weight_version": version}
            if trained == redo_from_iteration and result is not None:
                cursor["result"] = result
            kept = ray.get(
                rank0.keep_state.remote(str(self.state_path()), cursor), timeout=KEEP_STATE_TIMEOUT_S
            )
        except (RayError, OSError) as exc:
            return {
                "kept": False,
                "why": f"the trainer's rank 0 could not write its state: {_first_line(exc)}",
            }
        log.info(
            "job %s: kept the trainer's state after iteration %s (%s bytes)",
            self.job_id,
            trained,
            kept["bytes"],
        )
        return {"kept": True, "iteration": trained, **kept}

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
            self._run_loop()
        finally:
            with self._changed:
                self._loop_ended = True
                self._changed.notify_all()

    def _run_loop(self) -> None:
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
        """The job's workers whose actors are gone, asked of all at once: its current members
        (a worker a migration stopped on purpose is not one of them)."""
        with self._lock:
            view = self._view
            members = {w for _, workers in view.members.values() for w in workers} if view else set()
            members |= set(self._ranks)
            current = {name: handle for name, handle in self._workers.items() if name in members}
        pings = {handle.__ray_ready__.remote(): name for name, handle in current.items()}
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
            if view.iteration > iteration or self._trained_through(iteration):
                continue  # already trained: by a driver restarted mid-job, or the layout this one replaced
            self._set(phase="generating", iteration=iteration, samples={}, trained_samples=0)
            report = run_iteration(
                self.config,
                f"j{self.job_id}",
                iteration,
                engines,
                reward,
                reference,
                trainer,
                progress=self._rollout_progress,
                agent=self._agent,
            )
            self._record(report, view)
        self.state_path().unlink(missing_ok=True)  # the job is done: nothing will resume from it

    def _recorded_version(self) -> str | None:
        with self._lock:
            return self._trained_version

    def _await_recorded(self, version: str, timeout_s: float) -> None:
        """Wait until the loop has recorded the iteration that left the trainer at ``version``."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: self._trained_version == version or self._loop_ended, timeout=timeout_s
            ):
                raise TimeoutError(
                    f"the iteration at weight version {version} was not recorded within {timeout_s:g} s"
                )

    def _trained_through(self, iteration: int) -> bool:
        with self._lock:
            return self._trained is not None and self._trained >= iteration

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
    ) -> tuple[EnginePool, EngineReference | None, RayReward, RayTrainerGroup]:
        def of_kind(kind: str) -> list[str]:
            return sorted(w for k, members in view.members.values() if k == kind for w in members)

        rollout_names, inference_names = of_kind("rollout"), of_kind("inference")
        actor_names, reward_names, tool_names = of_kind("actor"), of_kind("reward"), of_kind("tool")
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
        clients = {name: EngineClient(url) for name, url in urls.items()}
        self.load_warm_start(clients)
        initial = ray.put(weights)
        ranks = [workers[name] for name in actor_names]
        store = ray.get(ranks[0].host_store.remote(len(ranks)), timeout=SETUP_TIMEOUT_S)
        ray.get(
            [rank.join.remote(store, i, len(ranks), "dp-0", initial) for i, rank in enumerate(ranks)],
            timeout=SETUP_TIMEOUT_S,
        )
        resumed = self._resume(view, ranks)
        ray.get(ranks[0].connect_engines.remote([urls[n] for n in rollout_names]), timeout=SETUP_TIMEOUT_S)
        if resumed:
            # The engines loaded the warm start; they generate the next iteration with the
            # trained weights the job stopped at.
            ray.get(ranks[0].push_weights.remote(), timeout=SETUP_TIMEOUT_S)
        reference = None
        if inference_names:
            self._reference_pool = EnginePool({n: clients[n] for n in inference_names}, role="reference")
            reference = EngineReference(self._reference_pool)
        reward = self._reward = RayReward({n: workers[n] for n in reward_names})
        self._tools.set_members({n: workers[n] for n in tool_names})
        self._trainer.ranks = ranks
        self._ranks = list(actor_names)
        self._rollout_urls = [urls[n] for n in rollout_names]
        pool = self._pool = EnginePool({n: clients[n] for n in rollout_names})
        self._ready.set()
        return pool, reference, reward, self._trainer

    def _resume(self, view: _View, ranks: Sequence[Any]) -> bool:
        """A job placed anew mid-way (the control plane has opened an iteration past 0): every
        rank loads the trainer state the old layout kept after the iteration before it. Training
        never starts over from the warm start in the middle of a job: without that state the job
        fails with the reason."""
        if view.iteration == 0:
            return False
        path = self.state_path()
        try:
            loaded = ray.get([rank.resume_state.remote(str(path)) for rank in ranks], timeout=SETUP_TIMEOUT_S)
        except RayError as exc:
            raise JobFailed(
                f"the job resumes at iteration {view.iteration} but its trainer's state was not kept: "
                f"{_first_line(exc)}"
            ) from exc
        cursor = loaded[0]["cursor"]
        trained = cursor.get("trained_iteration")
        if trained not in (view.iteration - 1, view.iteration):
            raise JobFailed(
                f"the job resumes at iteration {view.iteration} but the trainer state kept at {path} is "
                f"after iteration {trained}"
            )
        with self._lock:
            self._trained = trained
            self._trained_version = str(cursor.get("weight_version", loaded[0]["step"]))
            result = cursor.get("result")
            if trained == view.iteration and isinstance(result, Mapping):
                # The old layout trained the iteration this one was to redo before it stopped: it
                # counts as trained, and its result goes out again (the control plane keeps one
                # per iteration), as the old driver may have stopped before a heartbeat took it.
                self._iteration = trained
                self._trained_samples = int(result.get("samples", 0))
                self._results.append(dict(result))
                self._phase = "trained"
        log.info("job %s: resumed at iteration %s from the trainer's kept state", self.job_id, view.iteration)
        return True

    @property
    def pool(self) -> EnginePool:
        """The rollout engines the loop sends requests to (a workload migration changes them)."""
        if self._pool is None:
            raise JobFailed("the job's rollout engines are not set up yet")
        return self._pool

    def load_warm_start(self, clients: Mapping[str, EngineClient]) -> None:
        """Every engine of ``clients`` loads the job's warm-start checkpoint: the weights the
        trainer starts from, and the reference's frozen ones for good."""
        checkpoint = warm_start_checkpoint(self.config, self.checkpoint_dir)
        for name, client in clients.items():
            result = client.update_weights_from_disk(str(checkpoint), weight_version=INITIAL_WEIGHT_VERSION)
            if not result.success:
                raise JobFailed(f"engine {name} could not load the warm-start weights: {result.message}")

    def call_group(self, kind: str) -> RayWorkerGroup:
        """The job's ``reward`` or ``tool`` workers as the loop calls them."""
        if kind == "reward":
            return self._reward
        if kind == "tool":
            return self._tools
        raise JobFailed(f"the job has no {kind or 'such'} workers that work in calls")

    def engines_of(self, kind: str) -> EnginePool:
        """The pool of the job's ``rollout`` or ``inference`` engines."""
        if kind == "rollout":
            return self.pool
        if kind == "inference" and self._reference_pool is not None:
            return self._reference_pool
        raise JobFailed(f"the job has no {kind or 'such'} engines")

    def _rollout_progress(self, samples: dict[str, tuple[int, int]]) -> None:
        """The rollout's samples per engine as they finish, so each heartbeat shows the control
        plane which engines are done mid-iteration (the long tail it moves GPUs out of)."""
        with self._lock:
            self._samples = dict(samples)

    def _record(self, report: IterationReport, view: _View) -> None:
        per_engine = dict(zip(self.pool.names, report.samples_per_engine, strict=False))
        result = report_result(report)
        with self._lock:
            self._samples = {name: (count, count) for name, count in per_engine.items()}
            self._trained = report.iteration
            self._trained_version = report.weight_version
            self._trained_samples = report.samples
            self._results.append(result)
            self._phase = "trained"
            self._changed.notify_all()  # a re-placement waiting for this iteration to be recorded


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


# -- p2p migrations of the trainer ----------------------------------------------------------------

MIGRATION_TIMEOUT_S: Final = 300.0
# How long a failed transfer waits for its other ranks to give up before it reports.
ABANDON_WAIT_S: Final = 30.0


def worker_actor(worker: str) -> Any:
    """The actor of ``worker`` wherever it runs (actors are named ``<node>/<worker>``)."""
    for name in ray.util.list_named_actors():
        if name.rpartition("/")[2] == worker:
            return ray.get_actor(name)
    raise JobFailed(f"worker {worker} has no actor in the Ray cluster")


@dataclass
class _Prepared:
    migration: str
    generation: str
    members: list[str]
    handles: list[Any]


class _OncePerStep:
    """Runs each (step, attempt) once: the nodes of a step all ask, and wait for one outcome."""

    kinds: frozenset[str] = frozenset()

    def __init__(self, driver: JobDriver) -> None:
        self.driver = driver
        self._lock = threading.Lock()  # the subclasses' own state
        self._steps = OncePerKey()

    def step(self, step: Mapping[str, Any]) -> dict[str, Any]:
        key = (str(step["step_id"]), int(step.get("attempt", 1)))
        return self._steps.run(key, lambda: self._run_readably(step), failures=(JobFailed,))

    def _run_readably(self, step: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return self._run(step)
        except (JobFailed, RayError, TimeoutError, ValueError, RuntimeError) as exc:
            raise JobFailed(f"{step.get('kind')}: {_first_line(exc)}") from exc

    def _run(self, step: Mapping[str, Any]) -> dict[str, Any]:
        kind = str(step["kind"])
        if kind not in self.kinds:
            raise JobFailed(f"{kind} is not a {type(self).__name__} step the driver carries out")
        migration = str(step["step_id"]).split(":", 1)[0]
        attempt = int(step.get("attempt", 1))
        workers = [str(w) for w in step.get("worker_ids", [])]
        if not self.driver._ready.wait(timeout=MIGRATION_TIMEOUT_S):
            raise JobFailed("the job is not set up yet")
        handler: Callable[[str, int, list[str]], dict[str, Any]] = getattr(self, f"_{kind}")
        return handler(migration, attempt, workers)


class P2pMigration(_OncePerStep):
    """The driver's side of a p2p migration (docs/migration-plans.md; runtime/rl/state_transfer.py):

    - ``transfer_state``: the gate is taken (no train step runs until the switch or the rollback),
      rank 0 of the running trainer sends its state to the new ranks over a transfer group of its
      own (a fresh store prefix), and every receiver's checksums must equal the sender's;
    - ``rebuild_groups``: every rank of the new layout (the staying ranks in their order, then the
      new ones) builds the next generation's DP group beside the current one, on a store its new
      rank 0 serves; ``restore_groups`` drops it;
    - ``barrier``: every rank of the new layout answers and holds the prepared group;
    - ``switch``: they all train in the new group; the ranks left out leave theirs; a new rank 0
      opens the weight push to the engines; the gate opens. ``discard_transfer`` opens it too.
    """

    kinds = P2P_KINDS

    def __init__(self, driver: JobDriver) -> None:
        super().__init__(driver)
        self._received: dict[str, list[str]] = {}
        self._prepared: _Prepared | None = None

    @property
    def _gate(self) -> TrainingGate:
        return self.driver._trainer.gate

    def _transfer_state(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        members = list(self.driver._ranks)
        receivers = sorted(w for w in workers if w not in members)
        self._gate.hold(migration, MIGRATION_TIMEOUT_S)
        if not receivers:  # a shrinking trainer: the staying ranks already hold the state
            return {"receivers": [], "bytes": 0}
        sender = self.driver._trainer.ranks[0]
        handles = [worker_actor(w) for w in receivers]
        ray.get([h.standby.remote() for h in handles], timeout=MIGRATION_TIMEOUT_S)
        world = 1 + len(handles)
        store = ray.get(sender.host_store.remote(world), timeout=MIGRATION_TIMEOUT_S)
        prefix = f"transfer-{migration}-a{attempt}"
        cursor = {"iteration": self.driver._iteration, "trained_iteration": self.driver._trained}
        calls = [sender.transfer.remote(store, 0, world, prefix, cursor)] + [
            h.transfer.remote(store, i, world, prefix, {}) for i, h in enumerate(handles, 1)
        ]
        self._await_transfer(calls, ["sender", *receivers], sender, store, world, prefix)
        reports: list[dict[str, Any]] = ray.get(calls, timeout=MIGRATION_TIMEOUT_S)
        sent = reports[0]["checksums"]
        wrong = [w for w, report in zip(receivers, reports[1:], strict=True) if report["checksums"] != sent]
        if wrong:
            raise JobFailed(f"{', '.join(wrong)} did not end with the sender's state")
        with self._lock:
            self._received[migration] = receivers
        return {
            "receivers": receivers,
            "bytes": int(reports[0]["bytes"]) * len(receivers),
            "seconds": max(float(r["seconds"]) for r in reports),
            "step": int(reports[0]["step"]),
            "checksums": sent,
        }

    def _await_transfer(
        self, calls: list[Any], ranks: list[str], sender: Any, store: str, world: int, prefix: str
    ) -> None:
        """Wait for every rank's part of a transfer. The first that fails ends the wait: a
        receiver that died has the transfer abandoned, so the sender (a rank of the running
        trainer) stops waiting for it at once rather than at the rendezvous' timeout."""
        rank_of = {ref: name for ref, name in zip(calls, ranks, strict=True)}
        pending = list(calls)
        deadline = time.monotonic() + MIGRATION_TIMEOUT_S
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise JobFailed(f"the state transfer did not end within {MIGRATION_TIMEOUT_S:g} s")
            try:
                ray.get(done[0])
            except RayError as exc:
                why = f"{rank_of[done[0]]} failed: {_first_line(exc)}"
                if rank_of[done[0]] != "sender":
                    sender.abandon_transfer.remote(store, world, prefix, why)
                ray.wait(pending, num_returns=len(pending), timeout=ABANDON_WAIT_S)
                raise JobFailed(f"the state transfer failed: {why}") from exc

    def _discard_transfer(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        with self._lock:
            self._received.pop(migration, None)
        self._gate.release(migration)
        return {}

    def _order(self, workers: list[str]) -> list[str]:
        """The new layout's ranks: the staying ones in their order (rank 0 keeps the weight push
        when it stays), then the new ones by name."""
        members = self.driver._ranks
        return [w for w in members if w in workers] + sorted(w for w in workers if w not in members)

    def _rebuild_groups(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        self._gate.hold(migration, MIGRATION_TIMEOUT_S)
        members = self._order(workers)
        if not members:
            raise JobFailed("the new layout has no trainer rank")
        with self._lock:
            received = set(self._received.get(migration, []))
        missing = [w for w in members if w not in self.driver._ranks and w not in received]
        if missing:
            raise JobFailed(f"{', '.join(missing)} has not received the trainer's state")
        handles = [worker_actor(w) for w in members]
        generation = f"dp-{migration}-a{attempt}"
        store = ray.get(handles[0].host_store.remote(len(members)), timeout=MIGRATION_TIMEOUT_S)
        ray.get(
            [h.prepare.remote(store, rank, len(members), generation) for rank, h in enumerate(handles)],
            timeout=MIGRATION_TIMEOUT_S,
        )
        with self._lock:
            self._prepared = _Prepared(migration, generation, members, handles)
        return {"members": members, "generation": generation}

    def _restore_groups(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        with self._lock:
            prepared, self._prepared = self._prepared, None
        if prepared is not None:
            refs = [h.drop_prepared.remote() for h in prepared.handles]
            ray.wait(refs, num_returns=len(refs), timeout=MIGRATION_TIMEOUT_S)  # a dead rank holds nothing
        return {}

    def _ready_prepared(self, migration: str, workers: list[str]) -> _Prepared:
        with self._lock:
            prepared = self._prepared
        if prepared is None or prepared.migration != migration:
            raise JobFailed(f"no data-parallel group was rebuilt for migration {migration}")
        if set(prepared.members) != set(workers):
            raise JobFailed(f"the rebuilt group holds {prepared.members}, the step names {sorted(workers)}")
        return prepared

    def _barrier(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        prepared = self._ready_prepared(migration, workers)
        ray.get([h.__ray_ready__.remote() for h in prepared.handles], timeout=MIGRATION_TIMEOUT_S)
        return {"ranks": prepared.members}

    def _switch(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        prepared = self._ready_prepared(migration, workers)
        driver = self.driver
        old_members, old_ranks = list(driver._ranks), list(driver._trainer.ranks)
        ray.get([h.switch.remote() for h in prepared.handles], timeout=MIGRATION_TIMEOUT_S)
        leaving = [h for name, h in zip(old_members, old_ranks, strict=True) if name not in prepared.members]
        if leaving:  # they are stopped by destroy_old; a dead one has nothing to leave
            ray.wait(
                [h.leave.remote() for h in leaving], num_returns=len(leaving), timeout=MIGRATION_TIMEOUT_S
            )
        if prepared.members[0] != old_members[0]:
            if old_members[0] in prepared.members:
                ray.get(old_ranks[0].close_pusher.remote(), timeout=MIGRATION_TIMEOUT_S)
            ray.get(
                prepared.handles[0].connect_engines.remote(
                    driver._rollout_urls, f"weights-{prepared.generation}"
                ),
                timeout=MIGRATION_TIMEOUT_S,
            )
        with driver._lock:
            driver._trainer.ranks = list(prepared.handles)
            driver._ranks = list(prepared.members)
            for name in old_members:
                if name not in prepared.members:
                    driver._workers.pop(name, None)
            driver._workers.update(zip(prepared.members, prepared.handles, strict=True))
        with self._lock:
            self._prepared = None
            self._received.pop(migration, None)
        self._gate.release(migration)
        return {"members": prepared.members, "generation": prepared.generation}


class _GroupMigration(_OncePerStep):
    """A migration of one group whose kind the strategy must move (``moved_kinds``); the kind is
    kept per migration for its later steps."""

    moved_kinds: tuple[str, ...] = ()
    moves = ""  # what the strategy moves, for the refusal

    def __init__(self, driver: JobDriver) -> None:
        super().__init__(driver)
        self._kind_of: dict[str, str] = {}  # migration -> the kind of its group

    def _run(self, step: Mapping[str, Any]) -> dict[str, Any]:
        group = str(step.get("group", ""))
        kind = self.driver.kinds.get(group, "")
        if kind not in self.moved_kinds:
            raise JobFailed(f"{self.moves}; {group or 'this group'} ({kind or 'unknown kind'}) is not one")
        migration = str(step["step_id"]).split(":", 1)[0]
        with self._lock:
            self._kind_of[migration] = kind
            self._note(migration, step)
        return super()._run(step)

    def _note(self, migration: str, step: Mapping[str, Any]) -> None:
        """What else a subclass keeps of the migration's steps (lock held)."""

    def _kind(self, migration: str) -> str:
        with self._lock:
            return self._kind_of[migration]


class RestartMigration(_GroupMigration):
    """The driver's side of a ``restart`` migration of the reward or the tool group (their
    workers hold no state: they are stopped on the devices that leave and started on the ones
    that arrive):

    - ``drain``: the leaving workers get no new call (samples to score, tool calls); returns
      once their calls in flight ended (the agents then stop them); ``undrain`` puts them back,
      found again by name (an agent's ``restart_workers`` started them anew);
    - ``switch`` (the growing side): the group's members are exactly the step's workers.
    """

    kinds = frozenset({"drain", "undrain", "switch"})
    moved_kinds = RESTARTED_KINDS
    moves = "the ray runtime restarts reward and tool workers"

    def _group(self, migration: str) -> RayWorkerGroup:
        return self.driver.call_group(self._kind(migration))

    def _drain(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        self._group(migration).drain(workers, MIGRATION_TIMEOUT_S)
        return {"drained": sorted(workers)}

    def _undrain(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        self._group(migration).undrain({w: worker_actor(w) for w in workers})
        return {"undrained": sorted(workers)}

    def _switch(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        handles = {w: worker_actor(w) for w in workers}
        ray.get([h.__ray_ready__.remote() for h in handles.values()], timeout=MIGRATION_TIMEOUT_S)
        self._group(migration).set_members(handles)
        with self.driver._lock:
            self.driver._workers.update(handles)
        return {"members": sorted(workers)}


class WorkloadMigration(_GroupMigration):
    """The driver's side of a ``workload`` migration of the rollout or of the reference's
    ``inference`` engines (docs/ray-backend.md):

    - ``pause_workers``: the leaving engines get no new requests. Rollout engines are paused
      with SGLang's ``/pause_generation`` (mode ``abort``), which returns what they have in
      flight aborted with its partial output; the rollout resumes each such sample on the
      remaining engines (prompt + partial output, the rest of its token budget;
      `runtime.rl.loop.rollout`). A reference engine's requests are single prefills, so they
      are let finish. ``resume_workers`` continues them and routes to them again;
    - ``take_back_requests``: returns once nothing of the job is in flight on them;
      ``redistribute_requests``: the rollout already did (``return_requests``: nothing to give
      back: what moved keeps running where it went, which is equivalent);
    - ``release_devices``: the engines leave their pool (a rollout's: rank 0 opens the weight
      push to the remaining ones, under the training gate); their agents then stop them;
    - ``switch`` (a growing group): the new engines get their weights (a rollout's: the
      trainer's current ones, pushed by rank 0 to all engines over a new group; a reference's:
      the frozen warm-start checkpoint) and join the pool; ``shed_requests``: a growing
      rollout's old engines abort their share of the groups in flight (the latest begun first),
      which the rollout resumes on the least loaded engines, the new ones first, so an
      iteration's batch, all sent when it opened, spreads onto engines that join mid-way.
    """

    kinds = WORKLOAD_KINDS
    moved_kinds = ENGINE_KINDS
    moves = "the ray runtime moves rollout and inference engines by workload"

    def __init__(self, driver: JobDriver) -> None:
        super().__init__(driver)
        self._share_of: dict[str, float] = {}  # migration -> what its old members shed

    def _note(self, migration: str, step: Mapping[str, Any]) -> None:
        self._share_of[migration] = float(step.get("share", 0.0))

    def _engines(self, migration: str) -> tuple[str, EnginePool]:
        kind = self._kind(migration)
        return kind, self.driver.engines_of(kind)

    def _pooled(self, migration: str, workers: list[str]) -> tuple[str, EnginePool, list[str]]:
        """The kind and pool of the migration's engines, and which of ``workers`` are in it."""
        kind, pool = self._engines(migration)
        return kind, pool, [w for w in workers if w in pool.names]

    def _pause_workers(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        kind, pool, engines = self._pooled(migration, workers)
        pool.drain(engines)
        if kind == "rollout":
            for client in self._clients(pool, engines):
                client.pause_generation("abort")
        return {"paused": engines}

    def _resume_workers(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        kind, pool, engines = self._pooled(migration, workers)
        if kind == "rollout":
            for client in self._clients(pool, engines):
                client.continue_generation()
        pool.undrain(engines)
        return {"resumed": engines}

    def _take_back_requests(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        kind, pool, engines = self._pooled(migration, workers)
        if not pool.wait_idle(engines, MIGRATION_TIMEOUT_S):
            raise JobFailed(
                f"{', '.join(engines)} still had requests in flight after {MIGRATION_TIMEOUT_S:g} s"
            )
        return {"requests": [], "resumed_by": "rollout" if kind == "rollout" else "reference"}

    def _return_requests(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        return {"requests": []}

    def _redistribute_requests(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        return {"requests": 0}

    def _shed_requests(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        """The old members of a growing rollout abort their share of what they have in flight
        (``EnginePool.shed``: whole groups, the latest begun first); the rollout resumes each
        sample on the least loaded engine, the new ones first, with its partial output kept.
        A reference's requests are single prefills: nothing waits long enough to shed."""
        kind, pool, engines = self._pooled(migration, workers)
        if kind != "rollout":
            return {"requests": []}
        with self._lock:
            share = self._share_of.get(migration, 0.0)
        chosen = pool.shed(engines, share)
        clients = pool.named_clients()
        for engine, rids in chosen.items():
            for rid in rids:
                clients[engine].abort_request(rid)
        shed = sorted(rid for rids in chosen.values() for rid in rids)
        return {"requests": [], "shed": shed, "resumed_by": "rollout"}

    @staticmethod
    def _clients(pool: EnginePool, engines: list[str]) -> list[EngineClient]:
        return [client for name, client in pool.named_clients().items() if name in engines]

    def _rehome_push(self, migration: str, urls: list[str], push: bool) -> None:
        """Rank 0's weight push to exactly ``urls`` (a new group: the engines may hold the old
        one), and the current weights sent to them when ``push``; under the training gate."""
        driver = self.driver
        gate = driver._trainer.gate
        gate.hold(migration, MIGRATION_TIMEOUT_S)
        try:
            rank0 = driver._trainer.ranks[0]
            ray.get(rank0.connect_engines.remote(urls, f"weights-{migration}"), timeout=MIGRATION_TIMEOUT_S)
            if push:
                ray.get(rank0.push_weights.remote(), timeout=MIGRATION_TIMEOUT_S)
            driver._rollout_urls = list(urls)
        finally:
            gate.release(migration)

    def _release_devices(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        kind, pool, engines = self._pooled(migration, workers)
        remaining = [client.base_url for name, client in pool.named_clients().items() if name not in engines]
        if engines:
            pool.remove(engines)
            if kind == "rollout":
                self._rehome_push(migration, remaining, push=False)
        return {"released": engines}

    def _switch(self, migration: str, attempt: int, workers: list[str]) -> dict[str, Any]:
        kind, pool = self._engines(migration)
        current = pool.named_clients()
        new = [w for w in workers if w not in current]
        handles = {w: worker_actor(w) for w in new}
        urls = dict(
            zip(
                new,
                ray.get([h.url.remote() for h in handles.values()], timeout=MIGRATION_TIMEOUT_S),
                strict=True,
            )
        )
        clients = {w: EngineClient(urls[w]) for w in new}
        if new:
            if kind == "rollout":
                everyone = [c.base_url for c in current.values()] + [urls[w] for w in new]
                self._rehome_push(migration, everyone, push=True)
            else:
                self.driver.load_warm_start(clients)  # the reference never changes
            pool.add(clients)
            with self.driver._lock:
                self.driver._workers.update(handles)
        return {"members": sorted(pool.named_clients())}
