"""One simulated GPU host in virtual time: its devices, the workers on them, and their work.

No threads and no wall clock here: ``SimHost.advance_to(t)`` runs the host's events up to virtual
time ``t`` in a fixed order, so the same inputs at the same virtual times give the same state and
the same telemetry (``agents/backends/sim.py`` maps wall time onto virtual time and holds the lock).

What runs (docs/sim-backend.md has the whole model):

- **rollout** workers are inference engines of the core simulator (``scheduler.core.sim.engine``):
  continuous batching, memory-bound decode, prefill, KV pool and retraction, radix cache between
  the turns of an agentic episode. Each iteration's episodes are partitioned over the rollout
  group's workers as the control plane froze them for that iteration; this host runs the share of
  its own workers (and the shares the control plane asks it to adopt from workers that left).
- **inference** (log-prob) and **reward** workers consume the samples the upstream groups completed
  *globally* (the heartbeat reply's counts): worker ``p`` of ``W`` is entitled to the completed
  sample positions ``p, p + W, p + 2W, ...``; each takes its modelled forward-pass time.
- **actor** ranks train iteration ``k`` once every sample of ``k`` is through the upstream groups:
  the gang's FLOPs over its data-parallel ranks, plus a gradient sync per mini-batch. Every host
  of the gang follows the same fluid progress and reports the iteration trained.
- **tool** workers (sandboxes) serve the tool calls between turns, which the episodes model as
  latencies; they report busy while the rollout of the iteration is unfinished.

**Colocated** workers (a placement where groups of one job share devices, verl's and RLinf's
colocated mode) take turns: on each set of shared devices one stage is active at a time
(generate, then reward, then log-probs, then training, then generate again), the others are
offloaded, and a switch into or out of the rollout's stage costs the core simulator's colocated
phase switch (``PerfModel.colocate_switch_s``).
"""

from __future__ import annotations

import heapq
import math
import os
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agents.backends.sim_model import ITEM_KINDS, REWARD_PASSES, JobModel, SpecProblem, hardware_spec
from scheduler.core.hypergraph import Device
from scheduler.core.migration import COMPENSATION, StepKind
from scheduler.core.sim.engine import Engine, SimRequest
from scheduler.core.sim.episodes import Episode
from scheduler.core.sim.hardware import GB, HardwareSpec
from scheduler.core.sim.perf import largest_valid
from scheduler.core.sim.stages import (
    ACTOR,
    INFERENCE,
    LOG_PROB_PASSES,
    REWARD,
    ROLLOUT,
    TOOL,
    GpuWorkerBase,
    LogProbWorker,
    SampleMark,
    TrainerWorker,
    train_s,
)
from scheduler.core.sim.trace import TraceRecord

STEP_KINDS = frozenset(k.value for k in StepKind)
COMPENSATING_KINDS = frozenset(k.value for k in COMPENSATION.values() if k is not None)
ACTIVE_JOB_STATES = ("admitted", "running", "paused_scheduling")
PAUSED_FOREVER_S = 1e12  # an engine paused by a migration step: no decode step until resumed
JOB_RETENTION_S = 3600.0  # virtual seconds a job's progress is kept (and reported) once no worker is left
HANDOVER_S_PER_REQUEST = 0.001  # MigrationCostModel's per-request hand-over time
# A queued request shed to another engine carries no partial output or cache: the router only
# sends its prompt elsewhere, a tenth of what a taken-back request costs.
SHED_S_PER_REQUEST = 0.0001
HELD_SIDES_KEPT = 8  # take-back / shed sides whose requests a job keeps for retries

# Event kinds, in the order events of one instant run; telemetry samples come after all of them.
ENGINE, TOOL_DONE, READY, CONSUMED, TRAINED, TURN = range(6)

# Colocated stages in the order they take their turn on shared devices, as in verl's and RLinf's
# colocated mode: the rollout generates (tool sandboxes serve it meanwhile), the reward model
# scores, the reference / old-policy log-probs are computed, the actor trains; then generate again.
GENERATE, SCORE, LOG_PROBS, TRAIN = range(4)
STAGE = {ROLLOUT: GENERATE, TOOL: GENERATE, REWARD: SCORE, INFERENCE: LOG_PROBS, ACTOR: TRAIN}
STAGE_KIND = (ROLLOUT, REWARD, INFERENCE, ACTOR)  # the kind whose workers each stage runs


class Turn(StrEnum):
    """A time-shared worker's part in the turn-taking, reported with each telemetry sample."""

    ACTIVE = "active"  # its stage holds the shared devices
    ONLOADING = "onloading"  # its stage is being switched in (the switch cost is being paid)
    OFFLOADED = "offloaded"  # another stage holds the devices; it waits for its turn


class HostError(Exception):
    """A step or launch the host cannot carry out; the message says why (becomes StepFailed)."""


class WorkerState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"  # pause_workers: holds its requests, decodes nothing
    DRAINING = "draining"  # restart donor: finishes what it holds, takes nothing new
    STOPPED = "stopped"  # stop_workers step: the process is gone, the devices still held


ALIVE = (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.PAUSED, WorkerState.DRAINING)


@dataclass
class GroupView:
    kind: str
    workers: tuple[str, ...]
    completed: int
    total: int


@dataclass
class PartitionView:
    workers: tuple[str, ...]
    claimed: frozenset[str]
    adopt: dict[str, str]


@dataclass
class JobView:
    """The control plane's picture of a job, from the heartbeat reply (``scheduler.progress``)."""

    iteration: int
    state: str
    groups: dict[str, GroupView]
    partitions: dict[int, dict[str, PartitionView]]
    spec: Mapping[str, Any] | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobView:
        groups: dict[str, GroupView] = {}
        for name, group in (data.get("groups") or {}).items():
            groups[str(name)] = GroupView(
                kind=str(group.get("kind", "")),
                workers=tuple(sorted(str(w) for w in group.get("workers", ()))),
                completed=int(group.get("completed", 0)),
                total=int(group.get("total", 0)),
            )
        partitions: dict[int, dict[str, PartitionView]] = {}
        for iteration, by_group in (data.get("partitions") or {}).items():
            partitions[int(iteration)] = {
                str(name): PartitionView(
                    workers=tuple(str(w) for w in part.get("workers", ())),
                    claimed=frozenset(str(w) for w in part.get("claimed", ())),
                    adopt={str(k): str(v) for k, v in (part.get("adopt") or {}).items()},
                )
                for name, part in by_group.items()
            }
        spec = data.get("spec")
        return cls(
            iteration=int(data.get("iteration", 0)),
            state=str(data.get("state", "running")),
            groups=groups,
            partitions=partitions,
            spec=spec if isinstance(spec, Mapping) else None,
        )


@dataclass
class StepContext:
    """One migration step as this host sees it (the command payload, decoded)."""

    step_id: str
    attempt: int
    kind: str
    job_id: int
    group: str
    strategy: str
    worker_ids: tuple[str, ...]
    device_ids: tuple[str, ...]
    handover: Mapping[str, Any]
    spec: Mapping[str, Any] | None = None  # the job's spec, when the command carries it
    share: float = 0.0  # shed_requests: the fraction of each listed worker's queue it gives up

    @property
    def migration_id(self) -> str:
        return self.step_id.split(":", 1)[0]

    @property
    def side_key(self) -> str:
        """``migration:index``: shared by a step and its compensation."""
        return self.step_id.rsplit(":", 1)[0]

    def devices_by_worker(self) -> dict[str, tuple[str, ...]]:
        if not self.worker_ids or len(self.device_ids) % len(self.worker_ids):
            return {}
        per = len(self.device_ids) // len(self.worker_ids)
        return {w: self.device_ids[k * per : (k + 1) * per] for k, w in enumerate(self.worker_ids)}


@dataclass
class StepPlan:
    """What a step does after its first effects: wait ``duration_s`` (virtual), then ``finish``."""

    duration_s: float
    finish: Callable[[], dict[str, Any]]


@dataclass
class WorkerSampleRecord:
    at: float  # virtual seconds
    worker: str
    utilisation: float
    queue_length: int
    in_flight: int
    tokens: int
    progress: float | None
    turn: Turn | None = None  # time-shared workers only


@dataclass
class HostDevice:
    index: int
    hardware: HardwareSpec
    owner: str | None = None  # the worker holding it alone
    reserved_by: str | None = None  # migration side key of a p2p reservation
    # Workers of one job the control plane gave it as time-shared (a colocated placement).
    sharers: list[str] = field(default_factory=list)
    turn: int | None = None  # the stage whose turn it is, while it is time-shared
    turn_at: float = 0.0  # when that stage is switched in (becomes active)

    @property
    def holders(self) -> list[str]:
        return ([self.owner] if self.owner is not None else []) + self.sharers


class HostEpisode(Episode):
    """One sample of one iteration, while this host runs it."""

    __slots__ = ("group", "key", "rid", "serial", "tool_epoch", "tool_until", "worker")

    def __init__(
        self, key: tuple[int, int], group: str, record: TraceRecord, worker: str, serial: int
    ) -> None:
        super().__init__(record)
        self.key = key  # (iteration, episode index)
        self.group = group
        self.worker = worker
        self.serial = serial  # the engine's radix-cache key
        self.rid: int | None = None  # the request in an engine, if any
        self.tool_until: float | None = None
        self.tool_epoch = 0


@dataclass
class HostWorker:
    name: str
    job_id: int
    group: str
    kind: str
    devices: tuple[int, ...]
    hardware: tuple[HardwareSpec, ...]
    state: WorkerState
    member: bool  # part of its group's membership on this host (switch sets it)
    ready_at: float
    # Its busy seconds and tokens: a LogProbWorker for a log-prob or reward worker (its running
    # sample is its micro-batch), a TrainerWorker for a trainer rank.
    stage: GpuWorkerBase
    mark: SampleMark  # its integrals at its last telemetry sample
    joining: bool = False  # started by a migration step: unknown to the control plane until its switch
    engine: Engine | None = None
    colocated: bool = False  # launched on time-shared devices
    offloaded: bool = False  # time-shared and not its turn: does nothing until its stage is back
    offloaded_prefill_s: float = 0.0
    paused_prefill_s: float = 0.0
    taken_back: bool = False
    has_state: bool = False  # a new trainer rank that received its state shard
    done: int = 0  # samples consumed in iteration done_iteration
    done_iteration: int = -1
    epoch: int = 0

    @property
    def alive(self) -> bool:
        return self.state in ALIVE

    @property
    def consumer(self) -> LogProbWorker | None:
        """A log-prob or reward worker's forward passes."""
        return self.stage if isinstance(self.stage, LogProbWorker) else None

    @property
    def consuming(self) -> bool:
        """A log-prob or reward worker computing a sample."""
        return isinstance(self.stage, LogProbWorker) and bool(self.stage.batch)


@dataclass
class Training:
    iteration: int
    fraction: float
    updated_at: float
    total_s: float = math.inf
    data_parallel: int = 0
    tokens: int = 0
    active: frozenset[str] = frozenset()
    epoch: int = 0


@dataclass
class HostJob:
    model: JobModel
    view: JobView | None = None
    iteration: int = 0
    episodes: dict[tuple[int, int], HostEpisode] = field(default_factory=dict)
    done_keys: set[tuple[int, int]] = field(default_factory=set)
    completed: dict[int, dict[str, int]] = field(default_factory=dict)
    assigned: dict[int, dict[str, int]] = field(default_factory=dict)
    claims: dict[int, dict[str, set[str]]] = field(default_factory=dict)
    overrides: dict[str, tuple[str, ...]] = field(default_factory=dict)  # membership set by a switch
    rebuilt: dict[str, tuple[str, ...]] = field(default_factory=dict)
    held: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # take-back side key -> requests
    redistributed: set[str] = field(default_factory=set)
    training: Training | None = None
    trained_iteration: int | None = None
    empty_since: float | None = None

    def count(self, table: dict[int, dict[str, int]], iteration: int, group: str, delta: int) -> None:
        by_group = table.setdefault(iteration, {})
        by_group[group] = by_group.get(group, 0) + delta


class SimHost:
    """One host's devices, workers and jobs, advanced in virtual time by ``advance_to``. Not
    thread-safe: ``SimBackend`` holds its lock around every call."""

    def __init__(
        self,
        name: str,
        *,
        gpus: int,
        hardware: str,
        seed: int = 0,
        sample_every_s: float = 5.0,
        max_samples: int = 20_000,
        trace_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if gpus < 0:
            raise ValueError("gpus must be >= 0")
        if sample_every_s <= 0:
            raise ValueError("sample_every_s must be above 0")
        self.name = name
        self.hardware = hardware_spec(hardware)
        self.seed = seed
        self.trace_dir = trace_dir  # the only place job traces are read from (None: nowhere)
        self.devices = [HostDevice(index=i, hardware=self.hardware) for i in range(gpus)]
        self.workers: dict[str, HostWorker] = {}
        self.jobs: dict[int, HostJob] = {}
        self.pending_views: dict[int, JobView] = {}
        self.specs: dict[int, Mapping[str, Any]] = {}  # specs heard of (registration reply)
        self.requests: dict[int, HostEpisode] = {}
        self.now = 0.0
        self.sample_every_s = sample_every_s
        self._next_sample = sample_every_s
        self.samples: deque[WorkerSampleRecord] = deque(maxlen=max_samples)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._rid = 0
        self._serial = 0
        self._device_util: dict[int, list[float]] = {}
        self._time_sharing = False  # some workers here take turns on shared devices

    # == time ====================================================================================

    def advance_to(self, t: float) -> None:
        """Run every event up to virtual time ``t``, with a telemetry sample every
        ``sample_every_s`` after the events of that instant."""
        while True:
            event_at = self._heap[0][0] if self._heap else math.inf
            if event_at <= t and event_at <= self._next_sample:
                at, kind, _, payload = heapq.heappop(self._heap)
                self.now = max(self.now, at)
                self._handle(kind, payload)
                self._take_turns()
            elif self._next_sample <= t:
                self.now = max(self.now, self._next_sample)
                self._sample()
                self._next_sample += self.sample_every_s
            else:
                break
        self.now = max(self.now, t)
        self._take_turns()
        self._forget_idle_jobs()

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, kind, self._seq, payload))

    def _handle(self, kind: int, payload: Any) -> None:
        if kind == ENGINE:
            self._on_engine(*payload)
        elif kind == TOOL_DONE:
            self._on_tool(*payload)
        elif kind == READY:
            self._on_ready(*payload)
        elif kind == CONSUMED:
            self._on_consumed(*payload)
        elif kind == TRAINED:
            self._on_trained(*payload)
        # TURN only wakes the host when a stage switch ends: advance_to takes turns after each event.

    # == jobs and their views ======================================================================

    def ensure_job(self, job_id: int, spec: Mapping[str, Any] | None) -> HostJob:
        job = self.jobs.get(job_id)
        if job is not None:
            return job
        if spec is None:
            view = self.pending_views.get(job_id)
            spec = view.spec if view is not None else self.specs.get(job_id)
        if spec is None:
            raise HostError(f"job {job_id} is unknown on {self.name} and no spec came with the command")
        job = HostJob(model=JobModel(job_id, spec, seed=self.seed, trace_dir=self.trace_dir))
        self.jobs[job_id] = job
        self.specs.pop(job_id, None)
        view = self.pending_views.pop(job_id, None)
        if view is not None:
            job.view = view
            job.iteration = view.iteration
        return job

    def knows_job(self, job_id: int) -> bool:
        view = self.pending_views.get(job_id)
        return job_id in self.jobs or job_id in self.specs or (view is not None and view.spec is not None)

    def observe(self, views: Mapping[int, JobView]) -> None:
        # Views of jobs without workers here wait for their launch (only the latest reply's count).
        self.pending_views = {job_id: view for job_id, view in views.items() if job_id not in self.jobs}
        for job_id, view in views.items():
            job = self.jobs.get(job_id)
            if job is not None:
                self._apply_view(job, view)
        self._take_turns()

    def _apply_view(self, job: HostJob, view: JobView) -> None:
        previous = job.iteration if job.view is not None else None
        job.view = view
        if previous is not None and view.iteration > previous:
            self._new_iteration(job, view.iteration)
        job.iteration = max(job.iteration, view.iteration) if previous is not None else view.iteration
        for group, members in list(job.overrides.items()):
            shown = view.groups.get(group)
            if shown is not None and shown.workers == members:
                del job.overrides[group]
        self._materialise(job)
        self._kick_consumers(job)
        self._update_training(job)

    def _new_iteration(self, job: HostJob, iteration: int) -> None:
        """The trainer published new weights: engines pause for the update, old counters go.
        (Offloaded engines get the weights with their stage switch.)"""
        for worker in self._workers_of(job.model.job_id, kind=ROLLOUT):
            if worker.state is WorkerState.RUNNING and worker.engine is not None and not worker.offloaded:
                worker.engine.pause(self.now, job.model.weight_sync_s(len(worker.devices)))
                self._reschedule(worker)
        for table in (job.completed, job.assigned):
            for old in [b for b in table if b < iteration]:
                del table[old]
        for old in [b for b in job.claims if b < iteration]:
            del job.claims[old]
        job.done_keys = {key for key in job.done_keys if key[0] >= iteration}
        if job.training is not None and job.training.iteration < iteration:
            self._stop_training(job)

    def members(self, job: HostJob, group: str) -> tuple[str, ...]:
        """The group's membership across hosts: a switch this host ran, else the control plane's
        view, else (before any reply) this host's own members."""
        if group in job.overrides:
            return job.overrides[group]
        if job.view is not None and group in job.view.groups:
            return job.view.groups[group].workers
        return tuple(sorted(w.name for w in self._workers_of(job.model.job_id, group=group) if w.member))

    def _workers_of(
        self, job_id: int, *, group: str | None = None, kind: str | None = None
    ) -> list[HostWorker]:
        return [
            w
            for w in self.workers.values()
            if w.job_id == job_id and (group is None or w.group == group) and (kind is None or w.kind == kind)
        ]

    def _active(self, job: HostJob) -> bool:
        return job.view is None or job.view.state in ACTIVE_JOB_STATES

    def _global_completed(self, job: HostJob, group: str) -> int:
        if job.view is None:
            return 0
        shown = job.view.groups.get(group)
        return shown.completed if shown is not None else 0

    def _forget_idle_jobs(self) -> None:
        for job_id, job in list(self.jobs.items()):
            if any(w.job_id == job_id for w in self.workers.values()):
                job.empty_since = None
            elif job.empty_since is None:
                job.empty_since = self.now
            elif self.now - job.empty_since > JOB_RETENTION_S:
                del self.jobs[job_id]

    # == workers ==================================================================================

    def _start_s(self, model: JobModel, kind: str) -> float:
        if kind in (ROLLOUT, INFERENCE):
            return 0.6 * model.cost.engine_launch_s()
        if kind == ACTOR:
            return model.cost.engine_start_s
        return 0.6 * model.cost.restart_s

    def add_worker(
        self,
        job: HostJob,
        name: str,
        group: str,
        device_indices: Sequence[int],
        *,
        member: bool,
        shared: Collection[int] = (),
    ) -> HostWorker:
        """Start a worker (idempotent by name); it runs after its start time (a READY event).
        ``shared``: the devices the control plane gave it as time-shared with other workers of its
        job (a colocated placement); any other device must be free."""
        existing = self.workers.get(name)
        if existing is not None:
            if existing.job_id != job.model.job_id or existing.group != group:
                raise HostError(f"worker {name} already runs here for job {existing.job_id}/{existing.group}")
            if existing.state is WorkerState.STOPPED:
                self._restart(existing)
            return existing
        spec = job.model.group(group)
        if spec is None:
            raise HostError(f"job {job.model.job_id} has no group {group!r}")
        time_shared = frozenset(shared) & frozenset(device_indices)
        for index in device_indices:
            if not 0 <= index < len(self.devices):
                raise HostError(f"{self.name} has no device {index}")
            self._check_claim(job, name, group, self.devices[index], shared=index in time_shared)
        if not device_indices:
            raise HostError(f"worker {name} has no device on {self.name}")
        specs = tuple(self.devices[i].hardware for i in device_indices)
        devices = tuple(
            Device(id=f"{self.name}/gpu{i}", node=self.name, hardware=h.name, memory_gb=h.hbm_gb, index=i)
            for i, h in zip(device_indices, specs, strict=True)
        )
        stage: GpuWorkerBase
        if spec.kind in (INFERENCE, REWARD):
            stage = LogProbWorker.on(name, devices, job.model.perf(1))
        elif spec.kind == ACTOR:
            stage = TrainerWorker(name, devices)
        else:
            stage = GpuWorkerBase(name, devices)
        engine = None
        if spec.kind == ROLLOUT:
            tp = len(device_indices)
            coeffs = job.model.engine_coeffs(tp, self.hardware, colocated=bool(time_shared))
            engine = Engine(
                name,
                devices,
                coeffs,
                max_running=job.model.max_running,
                peak_tokens_per_s=job.model.engine_peak_tokens_per_s(tp, coeffs),
                kv_reserve_ratio=job.model.workload.perf.kv_reserve_ratio,
                now=self.now,
            )
        worker = HostWorker(
            name=name,
            job_id=job.model.job_id,
            group=group,
            kind=spec.kind,
            devices=tuple(device_indices),
            hardware=specs,
            state=WorkerState.STARTING,
            member=member,
            joining=not member,
            ready_at=self.now + self._start_s(job.model, spec.kind),
            stage=stage,
            mark=SampleMark(self.now),
            engine=engine,
            colocated=bool(time_shared),
        )
        for index in device_indices:
            device = self.devices[index]
            if index in time_shared:
                device.sharers.append(name)
            else:
                device.owner = name
            device.reserved_by = None
        self.workers[name] = worker
        job.empty_since = None
        self._push(worker.ready_at, READY, (worker, worker.epoch))
        self._take_turns()
        return worker

    def _check_claim(self, job: HostJob, name: str, group: str, device: HostDevice, *, shared: bool) -> None:
        """A device is held by one worker, or time-shared by workers of different groups of one
        job that the control plane all gave it as shared; never by two jobs."""
        others = [h for h in device.holders if h != name]
        if not others:
            return
        uid = f"{self.name}/gpu{device.index}"
        if not shared or device.owner not in (None, name):
            raise HostError(f"device {uid} is held by {device.owner or others[0]}")
        for other in others:
            sharer = self.workers[other]
            if sharer.job_id != job.model.job_id:
                raise HostError(
                    f"device {uid} is held by {other} of job {sharer.job_id}; only workers of one job "
                    "time-share a device"
                )
            if sharer.group == group:
                raise HostError(f"device {uid} is held by {other} of the same group {group!r}")

    def _restart(self, worker: HostWorker) -> None:
        worker.state = WorkerState.STARTING
        worker.epoch += 1
        worker.ready_at = self.now + self.jobs[worker.job_id].model.cost.restart_s
        self._push(worker.ready_at, READY, (worker, worker.epoch))

    def _on_ready(self, worker: HostWorker, epoch: int) -> None:
        if self.workers.get(worker.name) is not worker or epoch != worker.epoch:
            return
        if worker.state is not WorkerState.STARTING:
            return
        worker.state = WorkerState.RUNNING
        job = self.jobs[worker.job_id]
        if worker.engine is not None:
            worker.engine.commit(self.now)
            self._admit(worker)
        self._materialise(job)
        self._kick_consumers(job)
        self._update_training(job)

    def remove_worker(self, name: str, *, rehome: bool = True) -> bool:
        """The worker's process ends and its devices are freed. Requests it still held move to
        another running worker of its group here when ``rehome`` (a migration), else they end with
        it (the job is being stopped)."""
        worker = self.workers.pop(name, None)
        if worker is None:
            return False
        job = self.jobs.get(worker.job_id)
        worker.epoch += 1
        worker.stage.set_busy(False, self.now)
        for index in worker.devices:
            device = self.devices[index]
            if device.owner == name:
                device.owner = None
            if name in device.sharers:
                device.sharers.remove(name)
        if job is not None:
            self._rehome(job, worker, keep=rehome)
            self._update_training(job)
            self._kick_consumers(job)
        self._take_turns()
        return True

    def _rehome(self, job: HostJob, worker: HostWorker, *, keep: bool) -> None:
        if worker.engine is not None:
            finished, taken = worker.engine.take_back_all(self.now)
            for request in finished:
                self._turn_done(worker, request)
            for request in taken:
                episode = self.requests.pop(request.rid, None)
                if episode is not None:
                    episode.rid = None
                    episode.context = request.context
        leftovers = sorted((e for e in job.episodes.values() if e.worker == worker.name), key=lambda e: e.key)
        others = sorted(
            (w for w in self._workers_of(job.model.job_id, group=worker.group) if w.member and w.alive),
            key=lambda w: w.name,
        )
        for position, episode in enumerate(leftovers):
            if not others or not keep:
                # Nowhere to run it on this host: the job is being stopped, or the control plane
                # lets another worker adopt the share (it is no longer claimed here).
                del job.episodes[episode.key]
                job.count(job.assigned, episode.key[0], episode.group, -1)
                continue
            target = others[position % len(others)]
            episode.worker = target.name
            episode.tool_epoch += 1
            if episode.tool_until is not None and episode.tool_until > self.now:
                self._push(episode.tool_until, TOOL_DONE, (episode, episode.tool_epoch))
            else:
                episode.tool_until = None
                self._enqueue(target, self._new_request(episode, max_new=job.model.max_new_tokens, fresh=0))

    # == rollout ===================================================================================

    def _new_episode(
        self, job: HostJob, key: tuple[int, int], group: str, record: TraceRecord, worker: HostWorker
    ) -> HostEpisode:
        """Episode ``key`` is this host's now, on ``worker``."""
        self._serial += 1
        episode = HostEpisode(key, group, record, worker.name, self._serial)
        job.episodes[key] = episode
        job.count(job.assigned, key[0], group, 1)
        return episode

    def _new_request(
        self, episode: HostEpisode, *, max_new: int, remaining: int | None = None, fresh: int | None = None
    ) -> SimRequest:
        """The episode's current turn as an engine request (``episodes.Episode.request``); a
        request generates at least one token."""
        self._rid += 1
        left = episode.response_tokens if remaining is None else remaining
        request = episode.request(
            self._rid, episode.serial, self.now, max_new=max(max_new, 1), remaining=max(1, left), fresh=fresh
        )
        self.requests[request.rid] = episode
        episode.rid = request.rid
        return request

    def _enqueue(self, worker: HostWorker, request: SimRequest) -> None:
        assert worker.engine is not None
        worker.engine.local.append(request)
        if worker.state is WorkerState.RUNNING:
            self._admit(worker)

    def _admit(self, worker: HostWorker) -> None:
        engine = worker.engine
        if engine is None or worker.state is not WorkerState.RUNNING or worker.offloaded:
            return
        admitted = False
        while engine.local and engine.fits(engine.local[0], self.now):
            engine.add(engine.local.popleft(), self.now)
            admitted = True
        if admitted:
            engine.flush(self.now)
        self._reschedule(worker)

    def _reschedule(self, worker: HostWorker) -> None:
        engine = worker.engine
        if engine is None or worker.state is not WorkerState.RUNNING or worker.offloaded:
            return
        upcoming = engine.next_event()
        if upcoming is not None:
            self._push(upcoming[0], ENGINE, (worker, engine.epoch, upcoming[1]))

    def _on_engine(self, worker: HostWorker, epoch: int, step: int) -> None:
        engine = worker.engine
        if engine is None or epoch != engine.epoch or self.workers.get(worker.name) is not worker:
            return
        if worker.state is not WorkerState.RUNNING or worker.offloaded:
            return
        engine.advance_to_step(step)
        finished = engine.pop_finished()
        engine.retract_if_full()
        for request in finished:
            self._turn_done(worker, request)
        self._admit(worker)

    def _turn_done(self, worker: HostWorker, request: SimRequest) -> None:
        episode = self.requests.pop(request.rid, None)
        if episode is None:
            return
        episode.rid = None
        episode.context = request.context
        job = self.jobs[worker.job_id]
        if episode.has_next_turn:
            assert worker.engine is not None
            worker.engine.cache_episode(episode.serial, episode.context)
            episode.tool_epoch += 1
            episode.tool_until = self.now + episode.tool_latency_s
            self._push(episode.tool_until, TOOL_DONE, (episode, episode.tool_epoch))
            return
        job.episodes.pop(episode.key, None)
        job.done_keys.add(episode.key)
        job.count(job.completed, episode.key[0], episode.group, 1)

    def _on_tool(self, episode: HostEpisode, epoch: int) -> None:
        if epoch != episode.tool_epoch:
            return
        worker = self.workers.get(episode.worker)
        if worker is None:
            return
        job = self.jobs[worker.job_id]
        if job.episodes.get(episode.key) is not episode:
            return
        episode.tool_until = None
        episode.tool_done()  # the next turn's fresh tokens are the tool's output
        self._enqueue(worker, self._new_request(episode, max_new=job.model.max_new_tokens))

    def _materialise(self, job: HostJob) -> None:
        """Claim and start this host's shares of every iteration the control plane opened."""
        view = job.view
        if view is None or not self._active(job):
            return
        model = job.model
        for iteration in sorted(view.partitions):
            if iteration < job.iteration or iteration >= model.iterations:
                continue
            for group, part in sorted(view.partitions[iteration].items()):
                spec = model.group(group)
                if spec is None or spec.kind != ROLLOUT or not part.workers:
                    continue
                claimed = job.claims.setdefault(iteration, {}).setdefault(group, set())
                for position, member in enumerate(part.workers):
                    if member in claimed:
                        continue
                    target = self._runnable(job, group, member)
                    if target is None and member in part.adopt:
                        target = self._runnable(job, group, part.adopt[member])
                    if target is not None:
                        self._assign_share(job, iteration, group, len(part.workers), position, target)
                        claimed.add(member)

    def _runnable(self, job: HostJob, group: str, name: str) -> HostWorker | None:
        worker = self.workers.get(name)
        if (
            worker is None
            or worker.job_id != job.model.job_id
            or worker.group != group
            or not worker.member
            or worker.taken_back
            or worker.state not in (WorkerState.STARTING, WorkerState.RUNNING)
        ):
            return None
        return worker

    def _assign_share(
        self, job: HostJob, iteration: int, group: str, members: int, position: int, target: HostWorker
    ) -> None:
        records = job.model.records(iteration)
        for index in range(position, len(records), members):
            key = (iteration, index)
            if key in job.episodes or key in job.done_keys:
                continue
            episode = self._new_episode(job, key, group, records[index], target)
            assert target.engine is not None
            target.engine.local.append(self._new_request(episode, max_new=job.model.max_new_tokens))
        self._admit(target)

    # == log-prob and reward workers ================================================================

    def _kick_consumers(self, job: HostJob) -> None:
        for worker in self.workers.values():
            if worker.job_id == job.model.job_id and worker.kind in (INFERENCE, REWARD):
                self._kick_consumer(job, worker)

    def _entitlement(self, job: HostJob, worker: HostWorker) -> int:
        """Completed upstream sample positions p, p + W, ... below what upstream completed."""
        members = self.members(job, worker.group)
        if worker.name not in members or not worker.member:
            return 0
        upstream = job.model.upstream(worker.group)
        if not upstream:
            return 0
        available = min(self._global_completed(job, u) for u in upstream)
        available = min(available, job.model.samples_per_iteration)
        position = members.index(worker.name)
        return max(0, -(-(available - position) // len(members)))

    def _kick_consumer(self, job: HostJob, worker: HostWorker) -> None:
        consumer = worker.consumer
        if (
            consumer is None
            or consumer.batch
            or worker.state is not WorkerState.RUNNING
            or worker.offloaded
            or not self._active(job)
        ):
            return
        iteration = job.iteration
        if iteration >= job.model.iterations:
            return
        if worker.done_iteration != iteration:
            worker.done_iteration, worker.done = iteration, 0
        if worker.done >= self._entitlement(job, worker):
            return
        members = self.members(job, worker.group)
        position = members.index(worker.name) + worker.done * len(members)
        tokens = job.model.consumed_record(iteration, position).total_tokens
        passes = LOG_PROB_PASSES if worker.kind == INFERENCE else REWARD_PASSES
        # A micro-batch of one sample, as the core's log-prob workers run them.
        consumer.start([(position, tokens)], job.model.perf(1), passes, self.now)
        worker.epoch += 1
        self._push(consumer.ends_at, CONSUMED, (worker, worker.epoch))

    def _on_consumed(self, worker: HostWorker, epoch: int) -> None:
        consumer = worker.consumer
        if epoch != worker.epoch or self.workers.get(worker.name) is not worker or not worker.consuming:
            return
        assert consumer is not None
        consumer.finish(self.now)
        # done_iteration is the sample's: it changes only while the worker computes nothing.
        worker.done += 1
        job = self.jobs[worker.job_id]
        self._kick_consumer(job, worker)

    def _cancel_item(self, worker: HostWorker) -> None:
        consumer = worker.consumer
        if consumer is not None and consumer.batch:
            consumer.cancel(self.now)
            worker.epoch += 1

    # == the trainer =================================================================================

    def _actor_group(self, job: HostJob) -> str | None:
        return next((g.name for g in job.model.groups.values() if g.kind == ACTOR), None)

    def _upstream_done(self, job: HostJob, group: str) -> bool:
        total = job.model.samples_per_iteration
        upstream = job.model.upstream(group)
        return bool(upstream) and all(self._global_completed(job, u) >= total for u in upstream)

    def _advance_training(self, job: HostJob, training: Training) -> None:
        elapsed = self.now - training.updated_at
        if elapsed > 0 and math.isfinite(training.total_s) and training.total_s > 0:
            gained = min(1.0 - training.fraction, elapsed / training.total_s)
            if training.data_parallel > 0:
                per_rank = gained * training.tokens / training.data_parallel
                for name in training.active:
                    worker = self.workers.get(name)
                    if worker is not None:
                        worker.stage.tokens_done += per_rank
            training.fraction += gained
        training.updated_at = self.now

    def _stop_training(self, job: HostJob) -> None:
        training = job.training
        if training is None:
            return
        self._advance_training(job, training)
        for worker in self._workers_of(job.model.job_id, kind=ACTOR):
            worker.stage.set_busy(False, self.now)
        training.epoch += 1
        job.training = None

    def _update_training(self, job: HostJob) -> None:
        """(Re)plan this host's part of the gang's training of the job's current iteration."""
        group = self._actor_group(job)
        if group is None:
            return
        iteration = job.iteration
        ranks = sorted(
            (
                w
                for w in self._workers_of(job.model.job_id, group=group)
                if w.member and w.state is WorkerState.RUNNING and not w.offloaded
            ),
            key=lambda w: w.name,
        )
        training = job.training
        if training is not None and training.iteration != iteration:
            self._stop_training(job)
            training = None
        finished = job.trained_iteration is not None and job.trained_iteration >= iteration
        if not ranks or finished or iteration >= job.model.iterations or not self._active(job):
            self._stop_training(job)
            return
        total = job.model.samples_per_iteration
        if training is None:
            if not self._upstream_done(job, group):
                return
            # A rank joining a gang that is already training starts where the gang is.
            already = self._global_completed(job, group) / total if total else 0.0
            training = job.training = Training(
                iteration=iteration, fraction=min(already, 0.999), updated_at=self.now
            )
        else:
            self._advance_training(job, training)
        gang = self.members(job, group)
        spec = job.model.groups[group]
        data_parallel = largest_valid(len(gang), spec.valid_dp)
        flops, tokens = job.model.training(iteration)
        rank_rate = job.model.rank_flops_per_s(ranks[0].hardware)
        training.data_parallel = data_parallel
        training.tokens = tokens
        training.active = frozenset(gang[:data_parallel]) & {w.name for w in ranks}
        if data_parallel > 0 and rank_rate > 0:
            # The whole iteration in one go: its FLOPs at the gang's rate, one gradient sync per
            # mini-batch (the sync spread over the fluid, so every host reads the same fraction).
            training.total_s = train_s(
                job.model.perf(1),
                flops,
                data_parallel * rank_rate,
                minibatches=job.model.minibatches,
                data_parallel=data_parallel,
            )
        else:
            training.total_s = math.inf
        for worker in self._workers_of(job.model.job_id, kind=ACTOR):
            worker.stage.set_busy(
                worker.name in training.active and math.isfinite(training.total_s), self.now
            )
        training.epoch += 1
        if math.isfinite(training.total_s):
            ends = self.now + max(0.0, 1.0 - training.fraction) * training.total_s
            self._push(ends, TRAINED, (job, training, training.epoch))

    def _on_trained(self, job: HostJob, training: Training, epoch: int) -> None:
        if job.training is not training or epoch != training.epoch:
            return
        self._advance_training(job, training)
        training.fraction = 1.0
        job.trained_iteration = training.iteration
        for worker in self._workers_of(job.model.job_id, kind=ACTOR):
            worker.stage.set_busy(False, self.now)
        job.training = None

    def _training_fraction(self, job: HostJob, now: float) -> float:
        training = job.training
        if training is None:
            trained = job.trained_iteration is not None and job.trained_iteration >= job.iteration
            return 1.0 if trained else 0.0
        if not math.isfinite(training.total_s) or training.total_s <= 0:
            return training.fraction
        return min(1.0, training.fraction + max(0.0, now - training.updated_at) / training.total_s)

    # == colocated workers: turns on time-shared devices ==============================================

    def _time_shared(self, worker: HostWorker) -> bool:
        return any(len(self.devices[i].holders) > 1 for i in worker.devices)

    def _colocations(self) -> list[tuple[list[int], list[HostWorker]]]:
        """The sets of devices workers time-share, each with its workers: devices are in one set
        when a worker holds both or they share a holder (connected components)."""
        seen: set[int] = set()
        found: list[tuple[list[int], list[HostWorker]]] = []
        for start in self.devices:
            if start.index in seen or len(start.holders) < 2:
                continue
            seen.add(start.index)
            devices, names, pending = [], set(), [start.index]
            while pending:
                index = pending.pop()
                devices.append(index)
                for name in self.devices[index].holders:
                    if name in names:
                        continue
                    names.add(name)
                    for other in self.workers[name].devices:
                        if other not in seen:
                            seen.add(other)
                            pending.append(other)
            found.append((sorted(devices), [self.workers[n] for n in sorted(names)]))
        return found

    def _take_turns(self) -> None:
        """On each set of time-shared devices one stage is active at a time: the first stage, in
        the iteration's order, whose workers there still have work in the current iteration. A
        change of stage offloads the current one at once and switches the next one in after the
        core simulator's colocated switch time (when the rollout's stage is on either side)."""
        if not self._time_sharing and not any(d.sharers for d in self.devices):
            return  # the common case, checked after every event: nothing is time-shared here
        colocations = self._colocations()
        self._time_sharing = bool(colocations)
        shared: set[str] = set()
        for devices, workers in colocations:
            job = self.jobs[workers[0].job_id]
            shared.update(w.name for w in workers)
            turns = [self.devices[i] for i in devices if self.devices[i].turn is not None]
            current = turns[0].turn if turns else None
            turn_at = max((d.turn_at for d in turns if d.turn == current), default=self.now)
            wanted = self._wanted_stage(job, workers, current)
            if current is None:
                turn_at = self.now  # the first stage loads with the workers' start
            elif wanted != current:
                turn_at = self.now + self._switch_s(job, current, wanted)
                if turn_at > self.now:
                    self._push(turn_at, TURN, None)
            for index in devices:
                self.devices[index].turn, self.devices[index].turn_at = wanted, turn_at
            for worker in workers:
                holds = STAGE[worker.kind] == wanted and turn_at <= self.now
                if holds and worker.offloaded:
                    self._onload(job, worker)
                elif not holds and not worker.offloaded:
                    self._offload(job, worker)
        for worker in list(self.workers.values()):
            if worker.offloaded and worker.name not in shared:  # its sharers left: it runs alone
                self._onload(self.jobs[worker.job_id], worker)
        for device in self.devices:
            if device.turn is not None and len(device.holders) < 2:
                device.turn = None

    def _wanted_stage(self, job: HostJob, workers: Sequence[HostWorker], current: int | None) -> int:
        stages = sorted({STAGE[w.kind] for w in workers})
        if self._active(job) and job.iteration < job.model.iterations:
            for stage in stages:
                if not all(self._stage_done(job, w) for w in workers if STAGE[w.kind] == stage):
                    return stage
        # Nothing left until the control plane opens the next iteration: the devices stay as they are.
        return current if current in stages else stages[0]

    def _stage_done(self, job: HostJob, worker: HostWorker) -> bool:
        """Whether the worker has nothing left to do in the job's current iteration."""
        iteration, total = job.iteration, job.model.samples_per_iteration
        if worker.state is WorkerState.STOPPED or not worker.member:
            return True
        if worker.kind == ROLLOUT:
            view = job.view
            if view is None or iteration not in view.partitions:
                return False  # its share of the iteration is still to come
            part = view.partitions[iteration].get(worker.group)
            claimed = job.claims.get(iteration, {}).get(worker.group, set())
            if part is not None and worker.name in part.workers and worker.name not in claimed:
                return False
            engine = worker.engine
            if engine is not None and (engine.batch or engine.local):
                return False
            return not any(e.worker == worker.name and e.key[0] <= iteration for e in job.episodes.values())
        if worker.kind == TOOL:
            rollout = [g.name for g in job.model.groups.values() if g.kind == ROLLOUT]
            return all(self._global_completed(job, g) >= total for g in rollout)
        if worker.kind in (INFERENCE, REWARD):
            if worker.consuming:
                return False
            if any(self._global_completed(job, u) < total for u in job.model.upstream(worker.group)):
                return False
            done = worker.done if worker.done_iteration == iteration else 0
            return done >= self._entitlement(job, worker)
        return job.trained_iteration is not None and job.trained_iteration >= iteration

    @staticmethod
    def _switch_s(job: HostJob, current: int, wanted: int) -> float:
        # The trainer-side stages run in one process (as the core simulator's log-probs and
        # training): only a switch from or to the rollout offloads and onloads state.
        return job.model.stage_switch_s(STAGE_KIND[current], STAGE_KIND[wanted])

    def _offload(self, job: HostJob, worker: HostWorker) -> None:
        worker.offloaded = True
        if worker.engine is not None:
            engine = worker.engine
            engine.commit(self.now)
            worker.offloaded_prefill_s = max(0.0, engine.origin - self.now)
            engine.pause(self.now, PAUSED_FOREVER_S)
        self._cancel_item(worker)
        if worker.kind == ACTOR:
            self._update_training(job)

    def _onload(self, job: HostJob, worker: HostWorker) -> None:
        worker.offloaded = False
        if worker.engine is not None:
            worker.engine.origin = self.now + worker.offloaded_prefill_s
            worker.engine.epoch += 1
            self._admit(worker)
        if worker.kind in (INFERENCE, REWARD):
            self._kick_consumer(job, worker)
        elif worker.kind == ACTOR:
            self._update_training(job)

    def _turn_of(self, worker: HostWorker) -> Turn | None:
        if not self._time_shared(worker):
            return None
        if not worker.offloaded:
            return Turn.ACTIVE
        stage = self.devices[worker.devices[0]].turn
        return Turn.ONLOADING if stage == STAGE[worker.kind] else Turn.OFFLOADED

    def _resident(self, device: HostDevice) -> HostWorker | None:
        """The worker whose state fills the device: its holder, or of a time-shared device, the
        holder whose stage has the turn."""
        holders = [self.workers[n] for n in device.holders]
        if len(holders) > 1:
            return next((w for w in holders if STAGE[w.kind] == device.turn), holders[0])
        return holders[0] if holders else None

    # == telemetry ====================================================================================

    def _group_progress(self, job: HostJob, group: str, kind: str) -> float:
        total = job.model.samples_per_iteration
        if kind == ACTOR:
            return self._training_fraction(job, self.now)
        if not total:
            return 0.0
        return min(1.0, self._global_completed(job, group) / total)

    @staticmethod
    def _reported(worker: HostWorker) -> bool:
        """New workers not yet switched in are unknown to the control plane: not reported."""
        return worker.member or not worker.joining

    def _sample(self) -> None:
        now = self.now
        util_by_device: dict[int, float] = {}
        for name in sorted(self.workers):
            worker = self.workers[name]
            job = self.jobs.get(worker.job_id)
            if job is None:
                continue
            queue = in_flight = 0
            progress: float | None = None
            if worker.kind == ROLLOUT and worker.engine is not None:
                engine = worker.engine
                tokens = float(engine.decoded_at(now))
                work = tokens / engine.peak_tokens_per_s + engine.prefill_busy_at(now)
                queue = len(engine.local)
                in_flight = engine.batch
                progress = self._group_progress(job, worker.group, ROLLOUT)
            elif worker.kind in (INFERENCE, REWARD):
                assert worker.consumer is not None
                tokens = worker.consumer.tokens_at(now)
                work = worker.stage.busy_at(now)
                in_flight = 1 if worker.consuming else 0
                if worker.done_iteration == job.iteration:
                    queue = max(0, self._entitlement(job, worker) - worker.done - in_flight)
                progress = self._group_progress(job, worker.group, worker.kind)
            elif worker.kind == ACTOR:
                tokens = worker.stage.tokens_done
                training = job.training
                if training is not None and worker.name in training.active and training.data_parallel:
                    extra = self._training_fraction(job, now) - training.fraction
                    tokens += extra * training.tokens / training.data_parallel
                work = worker.stage.busy_at(now)
                in_flight = 1 if worker.stage.busy_since is not None else 0
                progress = self._training_fraction(job, now)
            else:  # tool sandboxes: busy while the iteration's rollout is unfinished
                tokens = 0.0
                rollout = [g.name for g in job.model.groups.values() if g.kind == ROLLOUT]
                left = 0.0
                if (
                    rollout
                    and worker.state is WorkerState.RUNNING
                    and not worker.offloaded
                    and self._active(job)
                ):
                    done = min(self._group_progress(job, g, ROLLOUT) for g in rollout)
                    left = 0.0 if job.iteration >= job.model.iterations else 1.0 - done
                work = worker.mark.work + left * (now - worker.mark.at)
            utilisation, delta = worker.mark.take(now, tokens, work)
            if worker.state is not WorkerState.RUNNING and worker.state is not WorkerState.DRAINING:
                utilisation = worker.mark.utilisation = 0.0
            for index in worker.devices:
                util_by_device[index] = max(utilisation, util_by_device.get(index, 0.0))
            if not self._reported(worker):
                continue
            self.samples.append(
                WorkerSampleRecord(
                    at=now,
                    worker=worker.name,
                    utilisation=round(utilisation, 6),
                    queue_length=queue,
                    in_flight=in_flight,
                    tokens=delta,
                    progress=None if progress is None else round(min(1.0, max(0.0, progress)), 6),
                    turn=self._turn_of(worker),
                )
            )
        for device in self.devices:
            self._device_util.setdefault(device.index, []).append(util_by_device.get(device.index, 0.0))

    def drain_samples(self) -> list[WorkerSampleRecord]:
        samples = list(self.samples)
        self.samples.clear()
        return samples

    def device_readings(self) -> list[tuple[int, float, float]]:
        """(index, mean utilisation since the last call, memory used GB) per device."""
        readings = []
        for device in self.devices:
            history = self._device_util.pop(device.index, [])
            if history:
                utilisation = sum(history) / len(history)
            else:
                resident = self._resident(device)
                utilisation = resident.mark.utilisation if resident is not None else 0.0
            readings.append((device.index, round(utilisation, 6), round(self._memory_gb(device), 3)))
        return readings

    def _memory_gb(self, device: HostDevice) -> float:
        worker = self._resident(device)
        if worker is None or not worker.alive:
            return 0.0
        hbm = device.hardware.hbm_gb
        job = self.jobs.get(worker.job_id)
        if job is None:
            return 0.0
        model = job.model.model
        gpus = max(1, len(worker.devices))
        if worker.kind == ROLLOUT:
            perf = job.model.workload.perf
            # Weights + a preallocated KV pool, smaller for an engine sharing its GPUs (colocated).
            used = hbm * (
                perf.colocated_engine_mem_fraction if worker.colocated else perf.engine_mem_fraction
            )
        elif worker.kind == ACTOR:
            training = job.training
            data_parallel = max(
                1, training.data_parallel if training else len(self.members(job, worker.group))
            )
            # BF16 weights and grads on every rank, optimizer state sharded over data parallel.
            used = (4.0 * model.params / gpus + 12.0 * model.params / (gpus * data_parallel)) / GB
            used += 0.15 * hbm if worker.stage.busy_since is not None else 0.0
        elif worker.kind in (INFERENCE, REWARD):
            used = model.weight_bytes / gpus / GB + (0.1 * hbm if worker.consuming else 0.0)
        else:
            used = 1.0
        if worker.state is WorkerState.STARTING:
            used *= 0.5
        return min(used, 0.95 * hbm)

    def progress_entries(self) -> list[dict[str, Any]]:
        """The heartbeat's ``jobs`` list: this host's part of each job's current iteration."""
        entries = []
        for job_id in sorted(self.jobs):
            job = self.jobs[job_id]
            iteration = job.iteration
            total = job.model.samples_per_iteration
            groups: dict[str, dict[str, int]] = {}
            for name, spec in job.model.groups.items():
                if spec.kind not in ITEM_KINDS:
                    continue
                local = [w for w in self._workers_of(job_id, group=name) if w.alive]
                if spec.kind == ROLLOUT:
                    completed = job.completed.get(iteration, {}).get(name, 0)
                    assigned = job.assigned.get(iteration, {}).get(name, 0)
                    if not local and not completed and not assigned:
                        continue
                elif spec.kind == ACTOR:
                    if not any(w.member for w in local):
                        continue
                    completed = min(total, math.floor(self._training_fraction(job, self.now) * total))
                    assigned = total
                else:
                    if not local:
                        continue
                    completed = assigned = 0
                    for worker in local:
                        entitled = self._entitlement(job, worker)
                        done = worker.done if worker.done_iteration == iteration else 0
                        completed += min(done, entitled)
                        assigned += entitled
                groups[name] = {"completed": completed, "assigned": assigned}
            entry: dict[str, Any] = {
                "job": job_id,
                "iteration": iteration,
                "groups": groups,
                "trained_iteration": job.trained_iteration,
            }
            claims = {
                str(b): {g: sorted(names) for g, names in sorted(by_group.items()) if names}
                for b, by_group in sorted(job.claims.items())
                if b >= iteration
            }
            claims = {b: c for b, c in claims.items() if c}
            if claims:
                entry["claims"] = claims
            entries.append(entry)
        return entries

    # == migration steps ===============================================================================

    def local_device(self, uid: str) -> int | None:
        host, _, rest = uid.rpartition("/")
        if host != self.name or not rest.startswith("gpu") or not rest[3:].isdigit():
            return None
        index = int(rest[3:])
        return index if index < len(self.devices) else None

    def _listed(self, ctx: StepContext) -> list[HostWorker]:
        return [
            self.workers[n]
            for n in ctx.worker_ids
            if n in self.workers and self.workers[n].job_id == ctx.job_id
        ]

    def _expected_here(self, ctx: StepContext) -> list[str]:
        """Listed workers that should run on this host: already here, or holding a device here."""
        expected = {w.name for w in self._listed(ctx)}
        for worker, devices in ctx.devices_by_worker().items():
            if any(self.local_device(d) is not None for d in devices):
                expected.add(worker)
        return sorted(expected)

    def _require_running(self, ctx: StepContext, *, need_state: bool = False) -> None:
        for name in self._expected_here(ctx):
            worker = self.workers.get(name)
            if worker is None or worker.job_id != ctx.job_id or not worker.alive:
                raise HostError(f"worker {name} is not running on {self.name}")
            if worker.state is WorkerState.STARTING:
                raise HostError(f"worker {name} on {self.name} is still starting")
            if need_state and worker.kind == ACTOR and not worker.member and not worker.has_state:
                raise HostError(f"rank {name} on {self.name} has not received the trainer state")

    def begin_step(self, ctx: StepContext) -> StepPlan:
        """Apply a step's first effects and say how long it takes; raises HostError."""
        handler = getattr(self, f"_step_{ctx.kind}", None) if ctx.kind in STEP_KINDS else None
        if handler is None:
            raise HostError(f"unknown step kind {ctx.kind!r}")
        if ctx.kind not in COMPENSATING_KINDS:
            self._refuse_time_shared(ctx)
        plan: StepPlan = handler(ctx)
        self._take_turns()
        return plan

    def _refuse_time_shared(self, ctx: StepContext) -> None:
        """Workers that take turns on shared devices are not resized: the planner does not move a
        time-shared device, and a step that would touch one fails before doing anything."""
        shared = [w.name for w in self._listed(ctx) if self._time_shared(w)]
        for uid in ctx.device_ids:
            index = self.local_device(uid)
            if index is not None and len(self.devices[index].holders) > 1:
                shared.append(uid)
        if shared:
            raise HostError(
                f"{', '.join(shared)} time-share devices (colocated placement); migration steps do not "
                "apply to them"
            )

    def _job_for(self, ctx: StepContext) -> HostJob | None:
        return self.jobs.get(ctx.job_id)

    @staticmethod
    def _done(result: dict[str, Any] | None = None) -> Callable[[], dict[str, Any]]:
        return lambda: dict(result or {})

    def _fixed_p2p_s(self, ctx: StepContext) -> float:
        job = self._job_for(ctx)
        return job.model.cost.p2p_fixed_s if job else 0.0

    def _launch_s(self, ctx: StepContext) -> float:
        job = self._job_for(ctx)
        if job is None:
            return 0.0
        spec = job.model.group(ctx.group)
        if spec is not None and spec.kind in (REWARD, TOOL):
            return job.model.cost.restart_s
        return job.model.cost.engine_launch_s()

    # -- workload strategy (serving groups) --------------------------------------------------------

    def _step_pause_workers(self, ctx: StepContext) -> StepPlan:
        paused = []
        for worker in self._listed(ctx):
            self._pause(worker)
            paused.append(worker.name)
        job = self._job_for(ctx)
        seconds = job.model.cost.workload_pause_s / 2 if job else 0.0
        return StepPlan(seconds, self._done({"paused": paused}))

    def _pause(self, worker: HostWorker) -> None:
        if worker.state is not WorkerState.RUNNING:
            return
        worker.state = WorkerState.PAUSED
        if worker.engine is not None:
            engine = worker.engine
            engine.commit(self.now)
            worker.paused_prefill_s = max(0.0, engine.origin - self.now)
            engine.pause(self.now, PAUSED_FOREVER_S)
        self._cancel_item(worker)
        job = self.jobs.get(worker.job_id)
        if job is not None:
            self._update_training(job)

    def _resume(self, worker: HostWorker) -> None:
        if worker.state is not WorkerState.PAUSED:
            return
        worker.state = WorkerState.RUNNING
        worker.taken_back = False
        if worker.engine is not None:
            worker.engine.origin = self.now + worker.paused_prefill_s
            worker.engine.epoch += 1
            self._admit(worker)
        job = self.jobs.get(worker.job_id)
        if job is not None:
            self._materialise(job)
            self._kick_consumers(job)
            self._update_training(job)

    def _step_resume_workers(self, ctx: StepContext) -> StepPlan:
        resumed = []
        for worker in self._listed(ctx):
            self._resume(worker)
            resumed.append(worker.name)
        job = self._job_for(ctx)
        seconds = job.model.cost.workload_pause_s / 2 if job else 0.0
        return StepPlan(seconds, self._done({"resumed": resumed}))

    def _step_take_back_requests(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        if job is None:
            return StepPlan(0.0, self._done({"requests": []}))
        held = self._hold(job, ctx.side_key)
        for worker in self._listed(ctx):
            if worker.kind != ROLLOUT or worker.engine is None:
                continue  # log-prob and reward work is re-partitioned by membership instead
            self._pause(worker)
            held.extend(self._take_back(job, worker))
            worker.taken_back = True
        held.sort(key=lambda r: (r["iteration"], r["episode"]))
        requests = list(held)
        return StepPlan(job.model.cost.workload_pause_s / 2, lambda: {"requests": requests})

    def _step_shed_requests(self, ctx: StepContext) -> StepPlan:
        """A growing rollout's old members give up ``share`` of the requests queued on them (not
        yet running: no cache is lost) for redistribute_requests to hand to the new members."""
        job = self._job_for(ctx)
        if job is None:
            return StepPlan(0.0, self._done({"requests": []}))
        if ctx.side_key in job.held:  # another attempt: the same requests, nothing shed twice
            again = list(job.held[ctx.side_key])
            return StepPlan(0.0, lambda: {"requests": again})
        if not 0.0 <= ctx.share <= 1.0:
            raise HostError(f"step.share must be between 0 and 1, got {ctx.share}")
        held = self._hold(job, ctx.side_key)
        for worker in self._listed(ctx):
            if worker.kind != ROLLOUT or worker.engine is None:
                continue
            shed = self._detach(job, worker.engine.take_queued(int(len(worker.engine.local) * ctx.share)))
            self._forget(job, shed)
            held.extend(shed)
        held.sort(key=lambda r: (r["iteration"], r["episode"]))
        requests = list(held)
        return StepPlan(SHED_S_PER_REQUEST * len(requests), lambda: {"requests": requests})

    @staticmethod
    def _hold(job: HostJob, side_key: str) -> list[dict[str, Any]]:
        """The list a step's taken requests are kept in for its retries and compensation; only
        the last few migrations' are kept (a job runs one migration at a time)."""
        if side_key not in job.held:
            while len(job.held) >= HELD_SIDES_KEPT:
                del job.held[next(iter(job.held))]
        return job.held.setdefault(side_key, [])

    def _take_back(self, job: HostJob, worker: HostWorker) -> list[dict[str, Any]]:
        """Every unfinished episode the worker holds, with what it generated so far."""
        assert worker.engine is not None
        finished, taken = worker.engine.take_back_all(self.now)
        for request in finished:
            self._turn_done(worker, request)
        out = self._detach(job, taken)
        for episode in [
            e for e in job.episodes.values() if e.worker == worker.name and e.tool_until is not None
        ]:
            episode.tool_epoch += 1
            out.append(self._request_json(job, episode, episode.context, 0, job.model.max_new_tokens))
        self._forget(job, out)
        return out

    def _detach(self, job: HostJob, requests: Iterable[SimRequest]) -> list[dict[str, Any]]:
        """Requests taken off an engine, as handover entries with what they generated so far."""
        out: list[dict[str, Any]] = []
        for request in requests:
            episode = self.requests.pop(request.rid, None)
            if episode is None:
                continue
            episode.rid = None
            out.append(self._request_json(job, episode, request.context, request.generated, request.max_new))
        return out

    @staticmethod
    def _forget(job: HostJob, handed_over: Iterable[Mapping[str, Any]]) -> None:
        """Handed-over episodes are no longer this host's: whoever places them counts them."""
        for item in handed_over:
            key = (item["iteration"], item["episode"])
            job.episodes.pop(key, None)
            job.count(job.assigned, key[0], item["group"], -1)

    def _request_json(
        self, job: HostJob, episode: HostEpisode, context: int, generated: int, max_new: int
    ) -> dict[str, Any]:
        in_tool = episode.tool_until is not None
        return {
            "job": job.model.job_id,
            "group": episode.group,
            "iteration": episode.key[0],
            "episode": episode.key[1],
            "turn": episode.turn,
            "phase": "tool" if in_tool else "generate",
            "tool_wait_s": round(max(0.0, (episode.tool_until or self.now) - self.now), 6),
            "context_tokens": context,
            "generated_tokens": generated,
            "max_new_tokens": max_new,
            "from": episode.worker,
        }

    def _step_redistribute_requests(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        requests = ctx.handover.get("requests", [])
        if not isinstance(requests, list):
            raise HostError("handover.requests must be a list")
        if job is None or ctx.side_key in job.redistributed:
            return StepPlan(0.0, self._done({"placed": 0}))
        targets = sorted(ctx.worker_ids)
        placed: dict[str, int] = {}
        for position, raw in enumerate(requests):
            request = self._parse_request(job, raw, f"handover.requests[{position}]")
            if request is None or not targets:
                continue
            # The control plane names each request's worker ("to"); without it, in turn.
            named = raw.get("to")
            preferred = named if isinstance(named, str) else targets[position % len(targets)]
            target = self._runnable(job, request["group"], preferred)
            if target is None:
                if preferred in self.workers:
                    target = self._any_runnable(job, request["group"], position)
                if target is None:
                    continue  # another host's share
            if self._place(job, request, target):
                placed[target.name] = placed.get(target.name, 0) + 1
        job.redistributed.add(ctx.side_key)
        count = sum(placed.values())
        return StepPlan(HANDOVER_S_PER_REQUEST * count, self._done({"placed": count, "workers": placed}))

    def _step_return_requests(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        if job is None:
            return StepPlan(0.0, self._done({"returned": 0}))
        requests = ctx.handover.get("requests", [])
        if not isinstance(requests, list):
            raise HostError("handover.requests must be a list")
        returned = 0
        for position, raw in enumerate(requests):
            request = self._parse_request(job, raw, f"handover.requests[{position}]")
            if request is None:
                continue
            worker = self.workers.get(str(request.get("from", "")))
            if worker is None or worker.job_id != job.model.job_id or not worker.alive:
                continue
            worker.taken_back = False
            if self._place(job, request, worker):
                returned += 1
        for name in ctx.worker_ids:
            if name in self.workers:
                self.workers[name].taken_back = False
        job.held.pop(ctx.side_key, None)
        return StepPlan(HANDOVER_S_PER_REQUEST * returned, self._done({"returned": returned}))

    def _any_runnable(self, job: HostJob, group: str, position: int) -> HostWorker | None:
        candidates = sorted(
            (
                w
                for w in self._workers_of(job.model.job_id, group=group)
                if self._runnable(job, group, w.name)
            ),
            key=lambda w: w.name,
        )
        return candidates[position % len(candidates)] if candidates else None

    def _parse_request(self, job: HostJob, raw: Any, path: str) -> dict[str, Any] | None:
        if not isinstance(raw, Mapping):
            raise HostError(f"{path}: must be an object")
        if raw.get("job") != job.model.job_id:
            return None
        out: dict[str, Any] = {}
        for key in ("iteration", "episode", "turn", "context_tokens", "generated_tokens", "max_new_tokens"):
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise HostError(f"{path}.{key}: must be an integer >= 0")
            out[key] = value
        group = raw.get("group")
        if not isinstance(group, str) or job.model.group(group) is None:
            raise HostError(f"{path}.group: not a group of job {job.model.job_id}")
        wait = raw.get("tool_wait_s", 0.0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
            raise HostError(f"{path}.tool_wait_s: must be a number >= 0")
        records = job.model.records(out["iteration"])
        if out["episode"] >= len(records):
            raise HostError(f"{path}.episode: iteration {out['iteration']} has {len(records)} episodes")
        if out["turn"] >= records[out["episode"]].turns:
            raise HostError(f"{path}.turn: episode has {records[out['episode']].turns} turns")
        out.update(
            group=group,
            phase=raw.get("phase", "generate"),
            tool_wait_s=float(wait),
            **{"from": raw.get("from")},
        )
        return out

    def _place(self, job: HostJob, request: Mapping[str, Any], target: HostWorker) -> bool:
        """Resume a handed-over episode on ``target``: its partial output is now prompt (re-prefilled
        here, no cache), and it may generate only what the turn has left."""
        key = (int(request["iteration"]), int(request["episode"]))
        if key in job.episodes or key in job.done_keys:
            return False
        record = job.model.records(key[0])[key[1]]
        episode = self._new_episode(job, key, str(request["group"]), record, target)
        episode.turn = int(request["turn"])
        episode.context = int(request["context_tokens"])
        if request["phase"] == "tool":
            episode.tool_epoch += 1
            episode.tool_until = self.now + float(request["tool_wait_s"])
            self._push(episode.tool_until, TOOL_DONE, (episode, episode.tool_epoch))
            return True
        generated = int(request["generated_tokens"])
        sim_request = self._new_request(
            episode,
            max_new=int(request["max_new_tokens"]),
            remaining=episode.response_tokens - generated,
            fresh=0,
        )
        sim_request.generated = generated
        self._enqueue(target, sim_request)
        return True

    def _step_release_devices(self, ctx: StepContext) -> StepPlan:
        released = [w.name for w in self._listed(ctx)]
        for name in released:
            self.remove_worker(name)
        freed = []
        for uid in ctx.device_ids:
            index = self.local_device(uid)
            if index is None:
                continue
            device = self.devices[index]
            if not device.holders:  # a device another worker holds is not this step's to free
                device.reserved_by = None
                freed.append(uid)
        return StepPlan(0.0, self._done({"released": released, "devices": freed}))

    # -- restart strategy (reward, tool) -----------------------------------------------------------

    def _step_drain(self, ctx: StepContext) -> StepPlan:
        for worker in self._listed(ctx):
            if worker.state is WorkerState.RUNNING:
                worker.state = WorkerState.DRAINING
        job = self._job_for(ctx)
        return StepPlan(job.model.cost.restart_s / 2 if job else 0.0, self._done())

    def _step_undrain(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        for worker in self._listed(ctx):
            if worker.state is WorkerState.DRAINING:
                worker.state = WorkerState.RUNNING
                if job is not None:
                    self._kick_consumer(job, worker)
                self._admit(worker)
        return StepPlan(0.0, self._done())

    def _step_stop_workers(self, ctx: StepContext) -> StepPlan:
        stopped = []
        for worker in self._listed(ctx):
            if worker.alive:
                self._cancel_item(worker)
                worker.state = WorkerState.STOPPED
                worker.epoch += 1
                stopped.append(worker.name)
        job = self._job_for(ctx)
        if job is not None:
            self._update_training(job)
        return StepPlan(job.model.cost.restart_s / 2 if job else 0.0, self._done({"stopped": stopped}))

    def _step_restart_workers(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        restarted = []
        for worker in self._listed(ctx):
            if worker.state is WorkerState.STOPPED:
                self._restart(worker)
                restarted.append(worker.name)
        seconds = job.model.cost.restart_s if job and restarted else 0.0
        return StepPlan(seconds, self._done({"restarted": restarted}))

    # -- growing a group: start, check, switch ---------------------------------------------------------

    def _step_reserve_devices(self, ctx: StepContext) -> StepPlan:
        reserved = []
        for uid in ctx.device_ids:
            index = self.local_device(uid)
            if index is None:
                continue
            device = self.devices[index]
            if device.holders:
                raise HostError(f"device {uid} is held by {', '.join(device.holders)}")
            if device.reserved_by not in (None, ctx.migration_id):
                raise HostError(f"device {uid} is reserved by migration {device.reserved_by}")
            device.reserved_by = ctx.migration_id
            reserved.append(uid)
        return StepPlan(0.0, self._done({"reserved": reserved}))

    def _step_release_reservation(self, ctx: StepContext) -> StepPlan:
        for uid in ctx.device_ids:
            index = self.local_device(uid)
            if index is not None and self.devices[index].reserved_by == ctx.migration_id:
                self.devices[index].reserved_by = None
        return StepPlan(0.0, self._done())

    def _step_start_workers(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        if job is None:
            raise HostError(f"job {ctx.job_id} is unknown on {self.name}")
        started: list[HostWorker] = []
        for name, devices in ctx.devices_by_worker().items():
            local = [self.local_device(d) for d in devices]
            indices = [i for i in local if i is not None]
            if not indices:
                continue
            if len(indices) != len(local):
                raise HostError(f"worker {name} would span {self.name} and other hosts")
            try:
                started.append(self.add_worker(job, name, ctx.group, indices, member=False))
            except SpecProblem as exc:
                raise HostError(str(exc)) from exc
        ready_at = max((w.ready_at for w in started), default=self.now)
        names = [w.name for w in started]

        def finish() -> dict[str, Any]:
            failed = [
                n for n in names if n not in self.workers or self.workers[n].state is not WorkerState.RUNNING
            ]
            if failed:
                raise HostError(f"workers {failed} did not start on {self.name}")
            return {"started": names}

        return StepPlan(max(0.0, ready_at - self.now), finish)

    def _step_destroy_new(self, ctx: StepContext) -> StepPlan:
        destroyed = [w.name for w in self._listed(ctx) if not w.member]
        for name in destroyed:
            self.remove_worker(name)
        return StepPlan(0.0, self._done({"destroyed": destroyed}))

    def _step_health_check(self, ctx: StepContext) -> StepPlan:
        self._require_running(ctx)
        return StepPlan(0.3 * self._launch_s(ctx), self._done({"healthy": self._expected_here(ctx)}))

    # -- p2p strategy (the trainer) ------------------------------------------------------------------

    def _step_transfer_state(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        expected = self._expected_here(ctx)
        if job is None:
            if expected:
                raise HostError(f"job {ctx.job_id} is unknown on {self.name}")
            return StepPlan(0.0, self._done())
        self._require_running(ctx)
        listed = self._listed(ctx)
        members = set(self.members(job, ctx.group))
        spec = job.model.group(ctx.group)
        per_worker = spec.gpus_per_worker if spec else 1
        receiving = [w for w in ctx.worker_ids if w not in members]
        if receiving:  # a growing trainer: the new ranks receive their shards
            gpus_after = (len(members) + len(receiving)) * per_worker
        else:  # a shrinking trainer: the staying ranks receive the leaving ranks' shards
            gpus_after = max(1, len(members) - len(ctx.worker_ids)) * per_worker
        shard_gb = job.model.cost.trainer_state_gb / max(gpus_after, 1)
        seconds = shard_gb / job.model.cost.p2p_bandwidth_gb_s if expected else 0.0

        def finish() -> dict[str, Any]:
            for worker in listed:
                if self.workers.get(worker.name) is not worker or not worker.alive:
                    raise HostError(f"worker {worker.name} stopped during the transfer")
                if not worker.member:
                    worker.has_state = True
            return {"shard_gb": round(shard_gb, 6), "workers": [w.name for w in listed]}

        return StepPlan(seconds, finish)

    def _step_discard_transfer(self, ctx: StepContext) -> StepPlan:
        for worker in self._listed(ctx):
            if not worker.member:
                worker.has_state = False
        return StepPlan(0.0, self._done())

    def _step_rebuild_groups(self, ctx: StepContext) -> StepPlan:
        self._require_running(ctx)
        job = self._job_for(ctx)
        if job is not None:
            job.rebuilt[ctx.group] = tuple(sorted(ctx.worker_ids))
        return StepPlan(0.6 * self._fixed_p2p_s(ctx), self._done({"members": sorted(ctx.worker_ids)}))

    def _step_restore_groups(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        if job is not None:
            job.rebuilt.pop(ctx.group, None)
        return StepPlan(0.6 * self._fixed_p2p_s(ctx), self._done())

    def _step_barrier(self, ctx: StepContext) -> StepPlan:
        self._require_running(ctx, need_state=True)
        return StepPlan(0.3 * self._fixed_p2p_s(ctx), self._done({"ranks": self._expected_here(ctx)}))

    def _step_switch(self, ctx: StepContext) -> StepPlan:
        self._require_running(ctx, need_state=True)
        seconds = 0.1 * (self._fixed_p2p_s(ctx) if ctx.strategy == "p2p" else self._launch_s(ctx))
        members = tuple(sorted(ctx.worker_ids))

        def finish() -> dict[str, Any]:
            # Checked again at the flip: a rank lost while waiting fails the switch, which then
            # did not happen (the old membership stands).
            self._require_running(ctx, need_state=True)
            job = self._job_for(ctx)
            local: list[str] = []
            if job is not None:
                for worker in self._workers_of(ctx.job_id, group=ctx.group):
                    worker.member = worker.name in members
                    if worker.member:
                        local.append(worker.name)
                job.overrides[ctx.group] = members
                self._materialise(job)
                self._kick_consumers(job)
                self._update_training(job)
            return {"members": sorted(local)}

        return StepPlan(seconds, finish)

    def _step_destroy_old(self, ctx: StepContext) -> StepPlan:
        job = self._job_for(ctx)
        destroyed = []
        # The listed workers are the ranks the switch left out; their host may not have taken part
        # in the switch (it holds no staying rank), so they stop whatever their local membership.
        for worker in self._listed(ctx):
            worker.member = False
            if worker.alive:
                self._cancel_item(worker)
                worker.state = WorkerState.STOPPED
                worker.epoch += 1
                destroyed.append(worker.name)
        if job is not None:
            job.rebuilt.pop(ctx.group, None)
            self._update_training(job)
        return StepPlan(0.0, self._done({"destroyed": destroyed}))
