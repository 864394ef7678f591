"""``RayBackend``: the node agent's ``ray`` execution backend.

The agent joins the Ray cluster as a Ray driver and runs its node's workers as actors pinned to its
Ray node (``actors``). A job's workers on all nodes are run by one **job driver** per job
(``driver``): a detached, named actor that every agent launching workers of the job asks for with
``get_if_exists``, so exactly one exists whichever agent comes first. The driver finds the workers
by name, sets up what needs the whole job (the trainer's ranks and world, the warm-start weights,
the engines' weight-update group) and runs the RL loop, one iteration at a time as the control plane
opens it. The agents feed it the control plane's picture of the job (``observe_control``) and
report what it and their own workers did (``telemetry``): measured utilisation, queues, tokens,
the job's progress, each iteration's results, and a failure when a worker or the driver died.

Migration steps (``execute_step``) move the trainer's ranks (``p2p``), the rollout's and the
reference's engines (``workload``) and the reward and tool workers (``restart``): this node's workers start
and stop here, and the job driver carries out the job-wide part once for all the step's nodes. A
step it cannot carry out fails with a clear error, and the control plane rolls the migration back.

This module must not import Django: agents run on GPU hosts with a slim install.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from agents.backends.base import (
    DeviceInfo,
    DeviceReading,
    StepFailed,
    Telemetry,
    WorkerReading,
    local_device_index,
)
from agents.backends.ray import driver_client
from agents.backends.ray.actors import (
    ENGINE_KINDS,
    TRAINER_RANK_ACTOR,
    EngineWorker,
    RewardWorker,
    ToolWorker,
    WorkerUsage,
    actor_class,
    actor_name,
    job_of,
    node_workers,
    start_worker_actor,
    stop_worker,
    worker_handle,
)
from agents.backends.ray.connection import RayClusterError, RayNode, connect, find_node
from agents.backends.step_payload import StepContext, parse_step
from runtime.engine.client import EngineClient, EngineError
from runtime.rl.job import RLJobConfig

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE: Final = "dynarl"
LAUNCH_TIMEOUT_S: Final = 120.0
CALL_TIMEOUT_S: Final = 2.0
TELEMETRY_WAIT_S: Final = 1.0
STEP_TIMEOUT_S: Final = 600.0
# A re-placement's stop waits this long for the job's driver to keep the trainer's state.
KEEP_STATE_WAIT_S: Final = 300.0
# The strategies carried out, and which of their step kinds the job's driver does (once for all the
# step's nodes); the others are each node's own (starting and stopping its workers).
DRIVER_KINDS: Final = {
    "p2p": driver_client.P2P_KINDS,
    "restart": frozenset({"drain", "undrain", "switch"}),
    "workload": driver_client.WORKLOAD_KINDS,
}
SUPPORTED_KINDS: Final = (*ENGINE_KINDS, "actor", "reward", "tool")


@dataclass
class _Sample:
    """The previous usage reading of a worker, to report differences."""

    at: float
    usage: WorkerUsage


class RayBackend:
    """One node of a Ray cluster, as its agent drives it. Thread-safe."""

    name = "ray"
    # A step outlives the agent: the job driver (a detached actor) runs its part once per step
    # and attempt and keeps the outcome, and workers start and stop by name. So the agent carries
    # out again a step that an earlier agent process was interrupted in (agents/daemon/commands.py).
    resumes_interrupted_steps = True

    def __init__(
        self,
        host: str,
        *,
        address: str,
        namespace: str = DEFAULT_NAMESPACE,
        ray_node: str | None = None,
        gpus: int | None = None,
        hardware: str = "ray-logical",
        checkpoint_dir: str | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        """``host``: the agent's node name; ``ray_node``: its Ray node's name when that differs
        (``ray start --node-name``). ``gpus``: the devices to register, by default the GPUs the Ray
        node offers. ``checkpoint_dir``: where drivers keep warm-start checkpoints (a directory
        every node can read; by default one under the system's temporary directory)."""
        self.host = host
        self.namespace = namespace
        self.hardware = hardware
        connect(address, namespace=namespace, timeout_s=float(connect_timeout_s))
        self.node: RayNode = find_node(ray_node or host)
        self.gpus = int(self.node.gpus) if gpus is None else int(gpus)
        if self.gpus < 0 or self.gpus > self.node.gpus:
            raise RayClusterError(
                f"gpus={self.gpus}: the Ray node {self.node.name} offers {self.node.gpus:g} GPUs"
            )
        self.checkpoint_dir = checkpoint_dir or str(Path("/tmp") / "dynarl-checkpoints")
        self._lock = threading.Lock()
        self._payloads: dict[str, Mapping[str, Any]] = {}  # worker -> its launch payload
        self._samples: dict[str, _Sample] = {}
        self._lost: dict[int, str] = {}  # job -> why it cannot go on (a worker of ours died)
        self._engines: dict[str, EngineClient] = {}  # engine worker -> a client of its server
        self._closed = False

    # -- the agent's calls ---------------------------------------------------------------------

    def inventory(self) -> Sequence[DeviceInfo]:
        """The node's GPUs. A logical GPU has no memory of its own: it is registered with its share
        of the memory Ray gives workers on the node (NVML's figures replace it on a GPU host)."""
        share = round(max(self.node.memory_gb / max(self.gpus, 1), 0.01), 2)
        return [DeviceInfo(index=i, hardware=self.hardware, memory_gb=share) for i in range(self.gpus)]

    def launch_workers(self, job: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Make sure the job has its driver, start each worker as an actor on this node
        (idempotent by name), and return once every worker answers."""
        job_id = job.get("job")
        spec = job.get("spec")
        if isinstance(job_id, bool) or not isinstance(job_id, int) or not isinstance(spec, Mapping):
            raise StepFailed("the launch payload needs an integer 'job' and its 'spec'")
        try:
            config = driver_client.rl_config(spec)
        except ValueError as exc:
            problem = f"the job cannot run on the ray backend: {exc}"
            return {
                "ok": False,
                "workers": {str(w.get("worker")): {"ok": False, "error": problem} for w in workers},
            }
        # First, so that whichever node reports the job's workers first finds its driver there.
        driver_client.ensure_driver(job_id, spec, self.node, self.checkpoint_dir)
        handles: dict[str, Any] = {}
        outcomes: dict[str, dict[str, Any]] = {}
        for entry in workers:
            name = str(entry.get("worker", ""))
            try:
                handles[name] = self._start(entry, config, spec)
            except (StepFailed, ValueError, KeyError, TypeError) as exc:
                outcomes[name] = {"ok": False, "error": str(exc)}
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        engines: dict[str, dict[str, str]] = {}
        kinds = {str(w.get("worker")): str(w.get("kind")) for w in workers}
        for name, handle in handles.items():
            try:
                ray.get(handle.usage.remote(), timeout=max(1.0, deadline - time.monotonic()))
                if kinds.get(name) in ENGINE_KINDS:
                    engines[name] = ray.get(handle.describe.remote(), timeout=CALL_TIMEOUT_S)
            except (RayActorError, GetTimeoutError) as exc:
                outcomes[name] = {"ok": False, "error": f"worker {name} did not start: {exc}"}
                continue
            outcomes[name] = {"ok": True, "error": ""}
            with self._lock:
                self._payloads[name] = dict(next(w for w in workers if w.get("worker") == name))
        for name, engine in engines.items():
            if engine.get("note"):
                log.warning("worker %s: %s", name, engine["note"])
        # Kept with the launch command's record: which engine each rollout/inference worker runs.
        return {"ok": all(o["ok"] for o in outcomes.values()), "workers": outcomes, "engines": engines}

    def _start(self, entry: Mapping[str, Any], config: RLJobConfig, spec: Mapping[str, Any]) -> Any:
        name = str(entry["worker"])
        kind = str(entry["kind"])
        if kind not in SUPPORTED_KINDS:
            raise StepFailed(
                f"worker {name}: the ray runtime runs {', '.join(SUPPORTED_KINDS)} workers, not {kind!r}"
            )
        existing = worker_handle(self.node.name, name)
        if existing is not None:
            return existing
        devices = list(entry.get("devices", []))
        if kind in ENGINE_KINDS:
            settings = driver_client.engine_settings(config)
            return start_worker_actor(
                self.node,
                name,
                devices,
                EngineWorker,
                config.model.to_json(),
                settings,
                driver_client.requested_engine(spec),
            )
        if kind == "actor":
            return start_worker_actor(
                self.node, name, devices, actor_class(TRAINER_RANK_ACTOR), config.trainer_config()
            )
        if kind == "tool":
            return start_worker_actor(self.node, name, devices, ToolWorker, config.tool_latency_s)
        return start_worker_actor(self.node, name, devices, RewardWorker)

    def stop_workers(
        self, job_id: int, worker_names: Sequence[str], *, redo_from_iteration: int | None = None
    ) -> dict[str, Any]:
        """Kill the workers' actors; once a job has no worker left anywhere, its driver too. A job
        being placed anew (``redo_from_iteration``) first has its driver keep the trainer's state
        (``JobDriver.keep_state``): the new layout's driver resumes from it and redoes that
        iteration, instead of training from the warm start again."""
        stopped: dict[str, dict[str, Any]] = {}
        jobs = {job_id} if job_id else set()
        jobs |= {owner for name in worker_names if (owner := job_of(name)) is not None}
        kept = (
            {owner: self._keep_state(owner, redo_from_iteration) for owner in sorted(jobs)}
            if redo_from_iteration is not None
            else {}
        )
        for name in worker_names:
            self._forget(name)
            try:
                stop_worker(self.node.name, name)
                stopped[name] = {"ok": True, "error": ""}
            except TimeoutError as exc:
                stopped[name] = {"ok": False, "error": str(exc)}
        for owner in jobs:
            if not driver_client.job_actors(owner):
                driver_client.stop_driver(owner)
                with self._lock:
                    self._lost.pop(owner, None)
        result: dict[str, Any] = {"ok": all(o["ok"] for o in stopped.values()), "workers": stopped}
        if kept:
            result["trainer_state"] = {str(owner): outcome for owner, outcome in kept.items()}
        return result

    def _keep_state(self, job_id: int, redo_from_iteration: int) -> dict[str, Any]:
        """The job driver's ``keep_state`` (the first node to ask has it done), or why not. A
        stop goes on either way: the control plane is placing the job anew."""
        handle = driver_client.driver_handle(job_id)
        if handle is None:
            return {"kept": False, "why": "the job's driver is gone"}
        try:
            outcome: dict[str, Any] = ray.get(
                handle.keep_state.remote(redo_from_iteration), timeout=KEEP_STATE_WAIT_S
            )
        except RayError as exc:  # GetTimeoutError included
            outcome = {
                "kept": False,
                "why": f"the job's driver did not keep it: {str(exc).splitlines()[0][:300]}",
            }
        if not outcome.get("kept"):
            log.warning("job %s: the trainer's state was not kept: %s", job_id, outcome.get("why"))
        return outcome

    def execute_step(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """This node's part of a migration step (docs/ray-backend.md, "Migrations"): the trainer's
        ``p2p`` moves, the rollout and inference engines' ``workload`` moves and the reward and
        tool workers' ``restart`` moves. Starting and stopping this node's workers happens here; the job-wide part (a state
        transfer, groups, the rollout's routing, the weight push, membership) is the job driver's,
        once for all the step's nodes. A step that cannot be carried out raises StepFailed with
        the reason, and the control plane rolls the migration back."""
        ctx = parse_step(payload)
        if ctx.strategy not in DRIVER_KINDS:
            raise StepFailed(
                f"{self.host}: the ray backend moves the trainer (p2p), reward and tool workers (restart) and "
                f"rollout and inference engines (workload); "
                f"{ctx.strategy or 'unnamed'} steps ({ctx.kind}) are not among them"
            )
        try:
            if ctx.strategy == "workload" and ctx.kind == "release_devices":
                # The engines leave the rollout and the weight push first, then they stop here.
                released = self._driver_step(ctx)
                return {**released, "stopped": self._stop_listed(ctx)}
            if ctx.kind == "switch":
                switched = self._driver_step(ctx)
                self._adopt(ctx)
                return switched
            if ctx.kind in DRIVER_KINDS[ctx.strategy]:
                return self._driver_step(ctx)
            local = getattr(self, f"_step_{ctx.kind}", None)
            if local is None:
                raise StepFailed(f"{self.host}: unknown {ctx.strategy} step kind {ctx.kind!r}")
            result: dict[str, Any] = local(ctx)
            return result
        except (RayError, TimeoutError, ValueError) as exc:
            raise StepFailed(f"{self.host}: {ctx.kind}: {exc}") from exc

    def _driver_step(self, ctx: StepContext) -> dict[str, Any]:
        handle = driver_client.driver_handle(ctx.job_id)
        if handle is None:
            raise StepFailed(f"{self.host}: {ctx.kind}: job {ctx.job_id} has no driver")
        step = {
            "step_id": ctx.step_id,
            "attempt": ctx.attempt,
            "kind": ctx.kind,
            "strategy": ctx.strategy,
            "group": ctx.group,
            "worker_ids": list(ctx.worker_ids),
            "share": ctx.share,
        }
        try:
            result: dict[str, Any] = ray.get(handle.migration_step.remote(step), timeout=STEP_TIMEOUT_S)
        except RayTaskError as exc:
            raise StepFailed(f"{self.host}: {_cause(exc)}") from exc
        return result

    def _local_devices(self, ctx: StepContext) -> dict[str, list[dict[str, Any]]]:
        """The step's workers that run here, with their devices as a launch payload lists them."""
        placed: dict[str, list[dict[str, Any]]] = {}
        for worker, uids in ctx.devices_by_worker().items():
            indices = [self._local_index(uid) for uid in uids]
            local = [i for i in indices if i is not None]
            if not local:
                continue
            if len(local) != len(indices):
                raise StepFailed(f"{self.host}: worker {worker} would span this node and others")
            placed[worker] = [
                {"uid": uid, "index": index, "hardware": self.hardware, "shared": False}
                for uid, index in zip(uids, local, strict=True)
            ]
        return placed

    def _local_index(self, uid: str) -> int | None:
        return local_device_index(uid, self.host, self.gpus)

    def _step_reserve_devices(self, ctx: StepContext) -> dict[str, Any]:
        # A Ray node's devices are only what the control plane says they are: its reservation
        # row is the reservation. This node only checks that they are its own and unused.
        mine = [uid for uid in ctx.device_ids if self._local_index(uid) is not None]
        with self._lock:
            used = {
                str(device.get("uid"))
                for payload in self._payloads.values()
                for device in payload.get("devices", [])
                if not device.get("shared")
            }
        taken = sorted(set(mine) & used)
        if taken:
            raise StepFailed(f"{self.host}: devices {', '.join(taken)} are held by running workers")
        return {"reserved": mine}

    def _step_release_reservation(self, ctx: StepContext) -> dict[str, Any]:
        return {}

    def _step_start_workers(self, ctx: StepContext) -> dict[str, Any]:
        """The new workers placed here: trainer ranks started empty and on standby for the
        transfer, reward workers ready to score, engines serving (a rollout's or a reference's;
        the switch gives them their weights)."""
        placed = self._local_devices(ctx)
        if not placed:
            return {"started": []}
        driver, kind = self._driver_and_kind(ctx)
        payloads = self._launch_payloads(ctx, kind, placed)
        if kind == "actor":
            config = ray.get(driver.trainer_config.remote(), timeout=CALL_TIMEOUT_S * 5)
            handles = [
                self._start_actor(p, actor_class(TRAINER_RANK_ACTOR), config) for p in payloads.values()
            ]
            ray.get([h.standby.remote() for h in handles], timeout=LAUNCH_TIMEOUT_S)
        elif kind in driver_client.RESTARTED_KINDS:
            handles = self._start_call_workers(driver, kind, payloads)
        elif kind in ENGINE_KINDS:
            model, settings, requested = ray.get(driver.engine_launch.remote(), timeout=CALL_TIMEOUT_S * 5)
            handles = [
                self._start_actor(p, EngineWorker, model, settings, requested) for p in payloads.values()
            ]
            ray.get([h.usage.remote() for h in handles], timeout=LAUNCH_TIMEOUT_S)
        else:
            raise StepFailed(
                f"{self.host}: the ray runtime does not start {kind or 'unknown'} workers by migration"
            )
        with self._lock:
            self._payloads.update(payloads)
        return {"started": sorted(placed)}

    def _adopt(self, ctx: StepContext) -> None:
        """After a switch: the group's members placed here are this node's workers, also those an
        earlier agent process started (their payloads went with it)."""
        with self._lock:
            placed = {w: d for w, d in self._local_devices(ctx).items() if w not in self._payloads}
        if not placed:
            return
        _, kind = self._driver_and_kind(ctx)
        with self._lock:
            self._payloads.update(self._launch_payloads(ctx, kind, placed))

    def _driver_and_kind(self, ctx: StepContext) -> tuple[Any, str]:
        """The job's driver, and the kind of the step's group as the driver knows it."""
        driver = driver_client.driver_handle(ctx.job_id)
        if driver is None:
            raise StepFailed(f"{self.host}: job {ctx.job_id} has no driver to build its workers from")
        kind: str = ray.get(driver.group_kind.remote(ctx.group), timeout=CALL_TIMEOUT_S * 5)
        return driver, kind

    @staticmethod
    def _launch_payloads(
        ctx: StepContext, kind: str, placed: Mapping[str, list[dict[str, Any]]]
    ) -> dict[str, dict[str, Any]]:
        """The step's workers placed here, as a launch command lists them."""
        return {
            worker: {
                "worker": worker,
                "job": ctx.job_id,
                "group": ctx.group,
                "kind": kind,
                "devices": devices,
            }
            for worker, devices in placed.items()
        }

    def _start_actor(self, payload: Mapping[str, Any], cls: type, *args: Any) -> Any:
        """The worker's actor (idempotent by name: a retried step finds the one it started)."""
        worker = str(payload["worker"])
        existing = worker_handle(self.node.name, worker)
        return existing or start_worker_actor(self.node, worker, list(payload["devices"]), cls, *args)

    def _step_health_check(self, ctx: StepContext) -> dict[str, Any]:
        with self._lock:
            mine = [w for w in ctx.worker_ids if w in self._payloads]
        found = {w: worker_handle(self.node.name, w) for w in mine}
        gone = sorted(w for w, h in found.items() if h is None)
        if gone:
            raise StepFailed(f"{self.host}: {', '.join(gone)} is not running")
        ray.get([h.usage.remote() for h in found.values() if h is not None], timeout=CALL_TIMEOUT_S * 5)
        return {"healthy": sorted(mine)}

    def _step_stop_workers(self, ctx: StepContext) -> dict[str, Any]:
        """A restart's leaving workers (drained by the driver): stopped."""
        return {"stopped": self._stop_listed(ctx)}

    def _step_restart_workers(self, ctx: StepContext) -> dict[str, Any]:
        """A rollback's restart of the reward or tool workers the step stopped here, on the same
        devices; built from the step and the job's driver, so an agent restarted in between
        restarts them as well."""
        placed = self._local_devices(ctx)
        driver, kind = self._driver_and_kind(ctx)
        payloads = self._launch_payloads(ctx, kind, placed)
        self._start_call_workers(driver, kind, payloads)
        with self._lock:
            self._payloads.update(payloads)
        return {"restarted": sorted(payloads)}

    def _start_call_workers(
        self, driver: Any, kind: str, payloads: Mapping[str, Mapping[str, Any]]
    ) -> list[Any]:
        """Reward or tool workers (a restart's), ready to take calls."""
        if kind == "tool":
            latency = ray.get(driver.tool_latency.remote(), timeout=CALL_TIMEOUT_S * 5)
            handles = [self._start_actor(p, ToolWorker, latency) for p in payloads.values()]
        elif kind == "reward":
            handles = [self._start_actor(p, RewardWorker) for p in payloads.values()]
        else:
            raise StepFailed(f"{self.host}: the ray runtime does not restart {kind or 'unknown'} workers")
        ray.get([h.usage.remote() for h in handles], timeout=LAUNCH_TIMEOUT_S)
        return handles

    def _holds_any(self, workers: Iterable[str]) -> bool:
        """Whether any of ``workers`` is still this node's (not stopped on purpose)."""
        with self._lock:
            return any(name in self._payloads for name in workers)

    def _forget(self, worker: str) -> None:
        """Drop a worker from this node's books before its actor is killed: a telemetry pass
        asking it meanwhile must not take a worker stopped on purpose for one that died."""
        with self._lock:
            self._payloads.pop(worker, None)
            self._samples.pop(worker, None)
            client = self._engines.pop(worker, None)
        if client is not None:
            client.close()

    def _stop_listed(self, ctx: StepContext) -> list[str]:
        stopped = []
        for worker in ctx.worker_ids:
            self._forget(worker)
            if worker_handle(self.node.name, worker) is None:
                continue
            stop_worker(self.node.name, worker)
            stopped.append(worker)
        return stopped

    def _step_destroy_new(self, ctx: StepContext) -> dict[str, Any]:
        return {"destroyed": self._stop_listed(ctx)}

    def _step_destroy_old(self, ctx: StepContext) -> dict[str, Any]:
        """The ranks the switch left out (they already left their group): their actors stop."""
        return {"destroyed": self._stop_listed(ctx)}

    def _step_release_devices(self, ctx: StepContext) -> dict[str, Any]:
        released = self._stop_listed(ctx)
        return {
            "released": released,
            "devices": [u for u in ctx.device_ids if self._local_index(u) is not None],
        }

    def telemetry(self) -> Telemetry:
        """What the node's workers did since the previous call. Bounded in time (the heartbeat
        waits on it): every worker is asked at once, and one that does not answer within
        ``TELEMETRY_WAIT_S`` is left for the next call, which covers this interval too."""
        if self._closed:
            return Telemetry()  # the agent is exiting: its last heartbeat carries no readings
        now = time.time()
        workers: list[WorkerReading] = []
        cpu_by_device: dict[int, float] = {}
        with self._lock:
            payloads = dict(self._payloads)
        usages = self._usages(payloads)
        for name, payload in payloads.items():
            if name not in usages:
                continue
            handle, usage = usages[name]
            reading = self._read_worker(name, payload, handle, usage, now)
            if reading is None:
                continue
            workers.append(reading[0])
            for device in payload.get("devices", []):
                index = int(device["index"])
                cpu_by_device[index] = cpu_by_device.get(index, 0.0) + reading[1]
        # Without NVML (which the agent reads itself where present) a device's reading is the CPU
        # share of the worker processes holding it: on a CPU host that is where their work runs.
        devices = [
            DeviceReading(index=index, utilisation=min(1.0, share), memory_used_gb=0.0, source="process_cpu")
            for index, share in sorted(cpu_by_device.items())
        ]
        return Telemetry(devices=devices, workers=workers, jobs=self._job_entries(payloads))

    def _usages(self, payloads: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[Any, WorkerUsage]]:
        """Each worker's usage, asked of all at once; a worker whose actor is gone marks its job
        lost, one that is slow to answer is skipped."""
        pending: dict[Any, tuple[str, Any]] = {}
        for name in payloads:
            handle = worker_handle(self.node.name, name)
            if handle is None:
                self._mark_lost(name)
                continue
            pending[handle.usage.remote()] = (name, handle)
        usages: dict[str, tuple[Any, WorkerUsage]] = {}
        if not pending:
            return usages
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=TELEMETRY_WAIT_S)
        for ref in ready:
            name, handle = pending[ref]
            try:
                usages[name] = (handle, ray.get(ref))
            except RayActorError:
                self._mark_lost(name)
        return usages

    def _mark_lost(self, name: str) -> None:
        job = job_of(name)
        if job is not None:
            with self._lock:
                if name not in self._payloads:
                    return  # stopped on purpose while it was being asked
                self._lost.setdefault(job, f"worker {name} on {self.host} died (its Ray actor is gone)")

    def _read_worker(
        self, name: str, payload: Mapping[str, Any], handle: Any, usage: WorkerUsage, now: float
    ) -> tuple[WorkerReading, float] | None:
        with self._lock:
            previous = self._samples.get(name)
            self._samples[name] = _Sample(at=now, usage=usage)
        if previous is None:
            return None
        elapsed = max(now - previous.at, 1e-6)
        cpu_share = max(0.0, usage.cpu_s - previous.usage.cpu_s) / elapsed
        tokens = max(0, usage.tokens - previous.usage.tokens)
        kind = str(payload.get("kind"))
        if kind in ENGINE_KINDS:
            return self._engine_reading(name, handle, now, tokens), cpu_share
        busy = max(0.0, usage.busy_s - previous.usage.busy_s) / elapsed
        waiting = max(0.0, usage.waiting_s - previous.usage.waiting_s) / elapsed
        return (
            WorkerReading(
                worker=name, at=now, utilisation=min(1.0, busy), tokens=tokens, waiting=min(1.0, waiting)
            ),
            cpu_share,
        )

    def _engine_reading(self, name: str, handle: Any, now: float, tokens: int) -> WorkerReading:
        """An engine's load as it serves it (``/v1/loads``, as a real SGLang server would): running
        and waiting requests, utilisation as the decode steps' occupancy of the running slots
        where the engine reports it, else running over the most it runs at once."""
        with self._lock:
            client = self._engines.get(name)
        if client is None:
            try:
                url = str(ray.get(handle.url.remote(), timeout=CALL_TIMEOUT_S))
            except (GetTimeoutError, RayActorError):
                return WorkerReading(worker=name, at=now, utilisation=0.0, tokens=tokens)
            client = EngineClient(url, timeout_s=CALL_TIMEOUT_S)
            with self._lock:
                self._engines[name] = client
        try:
            load = client.loads()
        except (EngineError, OSError):
            return WorkerReading(worker=name, at=now, utilisation=0.0, tokens=tokens)
        ranks = load.raw.get("loads", []) if isinstance(load.raw, Mapping) else []
        occupancies = [
            float(rank["cpu_engine"]["decode_step_occupancy"])
            for rank in ranks
            if isinstance(rank, Mapping) and isinstance(rank.get("cpu_engine"), Mapping)
        ]
        if occupancies:
            occupancy = sum(occupancies) / len(occupancies)
        else:
            occupancy = load.num_running_reqs / max(1, load.max_running_requests or 1)
        return WorkerReading(
            worker=name,
            at=now,
            utilisation=min(1.0, float(occupancy)),
            queue_length=load.num_waiting_reqs,
            in_flight=load.num_running_reqs,
            tokens=tokens,
        )

    def _job_entries(self, payloads: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
        by_job: dict[int, dict[str, Mapping[str, Any]]] = {}
        for name, payload in payloads.items():
            job = job_of(name)
            if job is not None:
                by_job.setdefault(job, {})[name] = payload
        with self._lock:
            lost = dict(self._lost)
        entries = []
        # A job whose workers here are all gone is still reported: its failure must reach the
        # control plane.
        for job in sorted(set(by_job) | set(lost)):
            held = by_job.get(job, {})
            mine = list(held.values())
            progress = driver_client.driver_progress(job) if mine else None
            if progress is not None and progress.get("failure") and not self._holds_any(held):
                # Its workers here were stopped on purpose since the readings were taken (the job
                # placed anew, or ended), and its driver went with the last of them: that is no
                # failure of the job's.
                if job not in lost:
                    continue
                progress = None
            entry = driver_client.progress_entry(job, progress, mine)
            if job in lost:
                entry["failure"] = lost[job]
            entries.append(entry)
        return entries

    def observe_control(self, reply: Mapping[str, Any]) -> None:
        """Hand each job's picture (the heartbeat reply's ``jobs`` section) to its driver."""
        section = reply.get("jobs", reply) if isinstance(reply, Mapping) else {}
        if not isinstance(section, Mapping):
            return
        for key, view in section.items():
            if str(key).isdigit() and isinstance(view, Mapping) and "iteration" in view:
                driver_client.observe(int(key), view)

    def running_workers(self) -> Sequence[str]:
        return node_workers(self.node.name)

    def reconcile(self, workers: Sequence[Mapping[str, Any]], jobs: Mapping[str, Any]) -> dict[str, Any]:
        """After the agent registers again: keep the actors the control plane lists here (they
        ran on while the agent was away), stop those of jobs it no longer runs here. An unlisted
        actor of a listed job is kept: it is a migration's new worker before its switch, which the
        migration itself switches to or destroys (its steps outlive the agent). A listed worker
        whose actor is gone cannot be started again with its state: its job is reported failed."""
        wanted = {str(w["worker"]): w for w in workers}
        running = set(self.running_workers())
        extra = sorted(w for w in running - set(wanted) if str(job_of(w)) not in jobs)
        if extra:
            self.stop_workers(0, extra)
        with self._lock:
            for name, payload in wanted.items():
                job = job_of(name)
                if name in running:
                    self._payloads[name] = payload
                # A worker still starting is not watched yet: its launch command comes (again) and
                # starts it. One the control plane has running but whose actor is gone is lost.
                elif job is not None and payload.get("state") == "running":
                    self._lost.setdefault(
                        job, f"worker {name} on {self.host} was gone when its agent came back"
                    )
        return {"stopped": extra, "relaunched": []}

    def close(self) -> None:
        """Leave the cluster; the workers and drivers run on (they are detached)."""
        self._closed = True
        if ray.is_initialized():
            ray.shutdown()

    # -- inspection ----------------------------------------------------------------------------

    def actor_of(self, worker: str) -> str:
        return actor_name(self.node.name, worker)


def _cause(exc: RayTaskError) -> str:
    """The error a remote call raised, as its message (not Ray's traceback around it)."""
    cause = exc.cause if isinstance(exc.cause, BaseException) else None
    return str(cause) if cause is not None else str(exc).strip().splitlines()[-1]
