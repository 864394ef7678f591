"""A simulated host's telemetry: worker samples, device readings and the progress report.

Every ``sample_every_s`` virtual seconds ``host.SimHost`` has ``HostTelemetry.sample`` read each
worker's integrals (``stages.SampleMark``): a rollout engine's useful decode and prefill work, a
log-prob or reward worker's and a trainer rank's busy seconds and tokens, a tool sandbox's share of
the iteration's unfinished rollout. ``device_readings`` averages the samples per device and models
its memory; ``progress_entries`` is the heartbeat's report of this host's part of each job.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from agents.backends.sim.model import ITEM_KINDS
from agents.backends.sim.state import HostDevice, HostJob, HostWorker, WorkerState
from scheduler.core.sim.hardware import GB
from scheduler.core.sim.stages import ACTOR, INFERENCE, REWARD, ROLLOUT


class Turn(StrEnum):
    """A time-shared worker's part in the turn-taking, reported with each telemetry sample."""

    ACTIVE = "active"  # its stage holds the shared devices
    ONLOADING = "onloading"  # its stage is being switched in (the switch cost is being paid)
    OFFLOADED = "offloaded"  # another stage holds the devices; it waits for its turn


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


class TelemetrySource(Protocol):
    """What telemetry reads of a host (``host.SimHost``)."""

    now: float
    workers: dict[str, HostWorker]
    jobs: dict[int, HostJob]
    devices: list[HostDevice]

    def members(self, job: HostJob, group: str) -> tuple[str, ...]: ...

    def workers_of(
        self, job_id: int, *, group: str | None = None, kind: str | None = None
    ) -> list[HostWorker]: ...

    def active(self, job: HostJob) -> bool: ...

    def global_completed(self, job: HostJob, group: str) -> int: ...

    def entitlement(self, job: HostJob, worker: HostWorker) -> int: ...

    def training_fraction(self, job: HostJob, now: float) -> float: ...

    def turn_of(self, worker: HostWorker) -> Turn | None: ...

    def resident(self, device: HostDevice) -> HostWorker | None: ...


class HostTelemetry:
    """The samples a host took since they were last drained, and its devices' utilisation."""

    def __init__(self, host: TelemetrySource, *, max_samples: int) -> None:
        self.host = host
        self.samples: deque[WorkerSampleRecord] = deque(maxlen=max_samples)
        self._device_util: dict[int, list[float]] = {}

    def _group_progress(self, job: HostJob, group: str, kind: str) -> float:
        total = job.model.samples_per_iteration
        if kind == ACTOR:
            return self.host.training_fraction(job, self.host.now)
        if not total:
            return 0.0
        return min(1.0, self.host.global_completed(job, group) / total)

    @staticmethod
    def _reported(worker: HostWorker) -> bool:
        """New workers not yet switched in are unknown to the control plane: not reported."""
        return worker.member or not worker.joining

    def sample(self) -> None:
        """One sample of every worker at the host's present (after the events of the instant)."""
        now = self.host.now
        util_by_device: dict[int, float] = {}
        for name in sorted(self.host.workers):
            worker = self.host.workers[name]
            job = self.host.jobs.get(worker.job_id)
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
                    queue = max(0, self.host.entitlement(job, worker) - worker.done - in_flight)
                progress = self._group_progress(job, worker.group, worker.kind)
            elif worker.kind == ACTOR:
                tokens = worker.stage.tokens_done
                training = job.training
                if training is not None and worker.name in training.active and training.data_parallel:
                    extra = self.host.training_fraction(job, now) - training.fraction
                    tokens += extra * training.tokens / training.data_parallel
                work = worker.stage.busy_at(now)
                in_flight = 1 if worker.stage.busy_since is not None else 0
                progress = self.host.training_fraction(job, now)
            else:  # tool sandboxes: busy while the iteration's rollout is unfinished
                tokens = 0.0
                rollout = [g.name for g in job.model.groups.values() if g.kind == ROLLOUT]
                left = 0.0
                if (
                    rollout
                    and worker.state is WorkerState.RUNNING
                    and not worker.offloaded
                    and self.host.active(job)
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
                    turn=self.host.turn_of(worker),
                )
            )
        for device in self.host.devices:
            self._device_util.setdefault(device.index, []).append(util_by_device.get(device.index, 0.0))

    def drain(self) -> list[WorkerSampleRecord]:
        samples = list(self.samples)
        self.samples.clear()
        return samples

    def device_readings(self) -> list[tuple[int, float, float]]:
        """(index, mean utilisation since the last call, memory used GB) per device."""
        readings = []
        for device in self.host.devices:
            history = self._device_util.pop(device.index, [])
            if history:
                utilisation = sum(history) / len(history)
            else:
                resident = self.host.resident(device)
                utilisation = resident.mark.utilisation if resident is not None else 0.0
            readings.append((device.index, round(utilisation, 6), round(self._memory_gb(device), 3)))
        return readings

    def _memory_gb(self, device: HostDevice) -> float:
        worker = self.host.resident(device)
        if worker is None or not worker.alive:
            return 0.0
        hbm = device.hardware.hbm_gb
        job = self.host.jobs.get(worker.job_id)
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
                1, training.data_parallel if training else len(self.host.members(job, worker.group))
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
        for job_id in sorted(self.host.jobs):
            job = self.host.jobs[job_id]
            iteration = job.iteration
            total = job.model.samples_per_iteration
            groups: dict[str, dict[str, int]] = {}
            for name, spec in job.model.groups.items():
                if spec.kind not in ITEM_KINDS:
                    continue
                local = [w for w in self.host.workers_of(job_id, group=name) if w.alive]
                if spec.kind == ROLLOUT:
                    completed = job.completed.get(iteration, {}).get(name, 0)
                    assigned = job.assigned.get(iteration, {}).get(name, 0)
                    if not local and not completed and not assigned:
                        continue
                elif spec.kind == ACTOR:
                    if not any(w.member for w in local):
                        continue
                    completed = min(
                        total, math.floor(self.host.training_fraction(job, self.host.now) * total)
                    )
                    assigned = total
                else:
                    if not local:
                        continue
                    completed = assigned = 0
                    for worker in local:
                        entitled = self.host.entitlement(job, worker)
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
