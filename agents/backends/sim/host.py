"""One simulated GPU host in virtual time: its devices, the workers on them, and their work.

No threads and no wall clock here: ``SimHost.advance_to(t)`` runs the host's events up to virtual
time ``t`` in a fixed order, so the same inputs at the same virtual times give the same state and
the same telemetry (``backend.py`` maps wall time onto virtual time and holds the lock).

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
phase switch (``stages.stage_switch_s``).

The workers' work is the core simulator's stage model (``scheduler/core/sim/stages.py``,
``episodes.py``); what is the host's own is where the work comes from: its share of each
iteration's episodes, entitlements to the samples the upstream groups completed over all hosts, a
gang training whole iterations across hosts, and the turns on time-shared devices. The records it
keeps are in ``state.py``, its telemetry in ``telemetry.py``; migration steps (``steps.py``) act on
it from outside.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from agents.backends.base import local_device_index
from agents.backends.sim.model import REWARD_PASSES, JobModel, hardware_spec
from agents.backends.sim.state import (
    ACTIVE_JOB_STATES,
    HostDevice,
    HostEpisode,
    HostError,
    HostJob,
    HostWorker,
    JobView,
    Training,
    WorkerState,
)
from agents.backends.sim.telemetry import HostTelemetry, Turn
from scheduler.core.hypergraph import Device
from scheduler.core.sim.engine import Engine, SimRequest
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

PAUSED_FOREVER_S = 1e12  # an engine paused by a migration step or offloaded: no decode step until resumed
JOB_RETENTION_S = 3600.0  # virtual seconds a job's progress is kept (and reported) once no worker is left

# Event kinds, in the order events of one instant run; telemetry samples come after all of them.
ENGINE, TOOL_DONE, READY, CONSUMED, TRAINED, TURN = range(6)

# Colocated stages in the order they take their turn on shared devices, as in verl's and RLinf's
# colocated mode: the rollout generates (tool sandboxes serve it meanwhile), the reward model
# scores, the reference / old-policy log-probs are computed, the actor trains; then generate again.
GENERATE, SCORE, LOG_PROBS, TRAIN = range(4)
STAGE = {ROLLOUT: GENERATE, TOOL: GENERATE, REWARD: SCORE, INFERENCE: LOG_PROBS, ACTOR: TRAIN}
STAGE_KIND = (ROLLOUT, REWARD, INFERENCE, ACTOR)  # the kind whose workers each stage runs


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
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._rid = 0
        self._serial = 0
        self._time_sharing = False  # some workers here take turns on shared devices
        self.telemetry = HostTelemetry(self, max_samples=max_samples)

    # == time ========================================================================================

    def advance_to(self, t: float) -> None:
        """Run every event up to virtual time ``t``, with a telemetry sample every
        ``sample_every_s`` after the events of that instant."""
        while True:
            event_at = self._heap[0][0] if self._heap else math.inf
            if event_at <= t and event_at <= self._next_sample:
                at, kind, _, payload = heapq.heappop(self._heap)
                self.now = max(self.now, at)
                self._handle(kind, payload)
                self.take_turns()
            elif self._next_sample <= t:
                self.now = max(self.now, self._next_sample)
                self.telemetry.sample()
                self._next_sample += self.sample_every_s
            else:
                break
        self.now = max(self.now, t)
        self.take_turns()
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

    # == jobs and their views ========================================================================

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
        self.take_turns()

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
        self.materialise(job)
        self.kick_consumers(job)
        self.update_training(job)

    def _new_iteration(self, job: HostJob, iteration: int) -> None:
        """The trainer published new weights: engines pause for the update, old counters go.
        (Offloaded engines get the weights with their stage switch.)"""
        for worker in self.workers_of(job.model.job_id, kind=ROLLOUT):
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
        return tuple(sorted(w.name for w in self.workers_of(job.model.job_id, group=group) if w.member))

    def workers_of(
        self, job_id: int, *, group: str | None = None, kind: str | None = None
    ) -> list[HostWorker]:
        return [
            w
            for w in self.workers.values()
            if w.job_id == job_id and (group is None or w.group == group) and (kind is None or w.kind == kind)
        ]

    def active(self, job: HostJob) -> bool:
        return job.view is None or job.view.state in ACTIVE_JOB_STATES

    def global_completed(self, job: HostJob, group: str) -> int:
        if job.view is None:
            return 0
        shown = job.view.groups.get(group)
        return shown.completed if shown is not None else 0

    def redo_from(self, job_id: int, iteration: int) -> None:
        """The job is being placed anew (its workers here have all stopped): what this host did of
        ``iteration`` and later is void, so the new layout's workers redo it from the start and
        the counts it reports begin again at zero."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        if job.training is not None and job.training.iteration >= iteration:
            self._stop_training(job)
        for table in (job.completed, job.assigned):
            for later in [i for i in table if i >= iteration]:
                del table[later]
        for later in [i for i in job.claims if i >= iteration]:
            del job.claims[later]
        job.done_keys = {key for key in job.done_keys if key[0] < iteration}
        # Membership a migration's switch set here names workers that are gone.
        job.overrides.clear()
        job.rebuilt.clear()

    def _forget_idle_jobs(self) -> None:
        for job_id, job in list(self.jobs.items()):
            if any(w.job_id == job_id for w in self.workers.values()):
                job.empty_since = None
            elif job.empty_since is None:
                job.empty_since = self.now
            elif self.now - job.empty_since > JOB_RETENTION_S:
                del self.jobs[job_id]

    # == workers =====================================================================================

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
                self.restart(existing)
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
        self.take_turns()
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

    def restart(self, worker: HostWorker) -> None:
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
            self.admit(worker)
        self.materialise(job)
        self.kick_consumers(job)
        self.update_training(job)

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
            self.update_training(job)
            self.kick_consumers(job)
        self.take_turns()
        return True

    def _rehome(self, job: HostJob, worker: HostWorker, *, keep: bool) -> None:
        if worker.engine is not None:
            finished, taken = worker.engine.take_back_all(self.now)
            for request in finished:
                self.turn_done(worker, request)
            for request in taken:
                episode = self.requests.pop(request.rid, None)
                if episode is not None:
                    episode.rid = None
                    episode.context = request.context
        leftovers = sorted((e for e in job.episodes.values() if e.worker == worker.name), key=lambda e: e.key)
        others = sorted(
            (w for w in self.workers_of(job.model.job_id, group=worker.group) if w.member and w.alive),
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
                self.enqueue(target, self.new_request(episode, max_new=job.model.max_new_tokens, fresh=0))

    def local_device(self, uid: str) -> int | None:
        return local_device_index(uid, self.name, len(self.devices))

    # == rollout =====================================================================================

    def new_episode(
        self, job: HostJob, key: tuple[int, int], group: str, record: TraceRecord, worker: HostWorker
    ) -> HostEpisode:
        """Episode ``key`` is this host's now, on ``worker``."""
        self._serial += 1
        episode = HostEpisode(key, group, record, worker.name, self._serial)
        job.episodes[key] = episode
        job.count(job.assigned, key[0], group, 1)
        return episode

    def new_request(
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

    def enqueue(self, worker: HostWorker, request: SimRequest) -> None:
        assert worker.engine is not None
        worker.engine.local.append(request)
        if worker.state is WorkerState.RUNNING:
            self.admit(worker)

    def admit(self, worker: HostWorker) -> None:
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
            self.turn_done(worker, request)
        self.admit(worker)

    def turn_done(self, worker: HostWorker, request: SimRequest) -> None:
        episode = self.requests.pop(request.rid, None)
        if episode is None:
            return
        episode.rid = None
        episode.context = request.context
        job = self.jobs[worker.job_id]
        if episode.has_next_turn:
            assert worker.engine is not None
            worker.engine.cache_episode(episode.serial, episode.context)
            self.call_tool(episode, self.now + episode.tool_latency_s)
            return
        job.episodes.pop(episode.key, None)
        job.done_keys.add(episode.key)
        job.count(job.completed, episode.key[0], episode.group, 1)

    def call_tool(self, episode: HostEpisode, until: float) -> None:
        """The episode waits for its tool call until ``until``, then its next turn starts."""
        episode.tool_epoch += 1
        episode.tool_until = until
        self._push(until, TOOL_DONE, (episode, episode.tool_epoch))

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
        self.enqueue(worker, self.new_request(episode, max_new=job.model.max_new_tokens))

    def materialise(self, job: HostJob) -> None:
        """Claim and start this host's shares of every iteration the control plane opened."""
        view = job.view
        if view is None or not self.active(job):
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
                    target = self.runnable(job, group, member)
                    if target is None and member in part.adopt:
                        target = self.runnable(job, group, part.adopt[member])
                    if target is not None:
                        self._assign_share(job, iteration, group, len(part.workers), position, target)
                        claimed.add(member)

    def runnable(self, job: HostJob, group: str, name: str) -> HostWorker | None:
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
            episode = self.new_episode(job, key, group, records[index], target)
            assert target.engine is not None
            target.engine.local.append(self.new_request(episode, max_new=job.model.max_new_tokens))
        self.admit(target)

    # == log-prob and reward workers =================================================================

    def kick_consumers(self, job: HostJob) -> None:
        for worker in self.workers.values():
            if worker.job_id == job.model.job_id and worker.kind in (INFERENCE, REWARD):
                self.kick_consumer(job, worker)

    def entitlement(self, job: HostJob, worker: HostWorker) -> int:
        """Completed upstream sample positions p, p + W, ... below what upstream completed."""
        members = self.members(job, worker.group)
        if worker.name not in members or not worker.member:
            return 0
        upstream = job.model.upstream(worker.group)
        if not upstream:
            return 0
        available = min(self.global_completed(job, u) for u in upstream)
        available = min(available, job.model.samples_per_iteration)
        position = members.index(worker.name)
        return max(0, -(-(available - position) // len(members)))

    def kick_consumer(self, job: HostJob, worker: HostWorker) -> None:
        consumer = worker.consumer
        if (
            consumer is None
            or consumer.batch
            or worker.state is not WorkerState.RUNNING
            or worker.offloaded
            or not self.active(job)
        ):
            return
        iteration = job.iteration
        if iteration >= job.model.iterations:
            return
        if worker.done_iteration != iteration:
            worker.done_iteration, worker.done = iteration, 0
        if worker.done >= self.entitlement(job, worker):
            return
        members = self.members(job, worker.group)
        position = members.index(worker.name) + worker.done * len(members)
        tokens = job.model.consumed_record(iteration, position).total_tokens
        passes = LOG_PROB_PASSES if worker.kind == INFERENCE else REWARD_PASSES
        # The core's forward-pass worker, with one sample per micro-batch.
        consumer.start([(position, tokens)], job.model.perf(1), passes, self.now)
        worker.epoch += 1
        self._push(consumer.ends_at, CONSUMED, (worker, worker.epoch))

    def _on_consumed(self, worker: HostWorker, epoch: int) -> None:
        consumer = worker.consumer
        if epoch != worker.epoch or self.workers.get(worker.name) is not worker:
            return
        if consumer is None or not consumer.batch:
            return
        consumer.finish(self.now)
        # done_iteration is the sample's: it changes only while the worker computes nothing.
        worker.done += 1
        job = self.jobs[worker.job_id]
        self.kick_consumer(job, worker)

    def cancel_item(self, worker: HostWorker) -> None:
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
        return bool(upstream) and all(self.global_completed(job, u) >= total for u in upstream)

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
        for worker in self.workers_of(job.model.job_id, kind=ACTOR):
            worker.stage.set_busy(False, self.now)
        training.epoch += 1
        job.training = None

    def update_training(self, job: HostJob) -> None:
        """(Re)plan this host's part of the gang's training of the job's current iteration."""
        group = self._actor_group(job)
        if group is None:
            return
        iteration = job.iteration
        ranks = sorted(
            (
                w
                for w in self.workers_of(job.model.job_id, group=group)
                if w.member and w.state is WorkerState.RUNNING and not w.offloaded
            ),
            key=lambda w: w.name,
        )
        training = job.training
        if training is not None and training.iteration != iteration:
            self._stop_training(job)
            training = None
        finished = job.trained_iteration is not None and job.trained_iteration >= iteration
        if not ranks or finished or iteration >= job.model.iterations or not self.active(job):
            self._stop_training(job)
            return
        total = job.model.samples_per_iteration
        if training is None:
            if not self._upstream_done(job, group):
                return
            # A rank joining a gang that is already training starts where the gang is.
            already = self.global_completed(job, group) / total if total else 0.0
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
        for worker in self.workers_of(job.model.job_id, kind=ACTOR):
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
        for worker in self.workers_of(job.model.job_id, kind=ACTOR):
            worker.stage.set_busy(False, self.now)
        job.training = None

    def training_fraction(self, job: HostJob, now: float) -> float:
        training = job.training
        if training is None:
            trained = job.trained_iteration is not None and job.trained_iteration >= job.iteration
            return 1.0 if trained else 0.0
        if not math.isfinite(training.total_s) or training.total_s <= 0:
            return training.fraction
        return min(1.0, training.fraction + max(0.0, now - training.updated_at) / training.total_s)

    # == colocated workers: turns on time-shared devices =============================================

    def time_shared(self, worker: HostWorker) -> bool:
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

    def take_turns(self) -> None:
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
        if self.active(job) and job.iteration < job.model.iterations:
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
            return all(self.global_completed(job, g) >= total for g in rollout)
        if worker.kind in (INFERENCE, REWARD):
            if worker.consuming:
                return False
            if any(self.global_completed(job, u) < total for u in job.model.upstream(worker.group)):
                return False
            done = worker.done if worker.done_iteration == iteration else 0
            return done >= self.entitlement(job, worker)
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
        self.cancel_item(worker)
        if worker.kind == ACTOR:
            self.update_training(job)

    def _onload(self, job: HostJob, worker: HostWorker) -> None:
        worker.offloaded = False
        if worker.engine is not None:
            worker.engine.origin = self.now + worker.offloaded_prefill_s
            worker.engine.epoch += 1
            self.admit(worker)
        if worker.kind in (INFERENCE, REWARD):
            self.kick_consumer(job, worker)
        elif worker.kind == ACTOR:
            self.update_training(job)

    def turn_of(self, worker: HostWorker) -> Turn | None:
        if not self.time_shared(worker):
            return None
        if not worker.offloaded:
            return Turn.ACTIVE
        stage = self.devices[worker.devices[0]].turn
        return Turn.ONLOADING if stage == STAGE[worker.kind] else Turn.OFFLOADED

    def resident(self, device: HostDevice) -> HostWorker | None:
        """The worker whose state fills the device: its holder, or of a time-shared device, the
        holder whose stage has the turn."""
        holders = [self.workers[n] for n in device.holders]
        if len(holders) > 1:
            return next((w for w in holders if STAGE[w.kind] == device.turn), holders[0])
        return holders[0] if holders else None
