"""The interface every execution backend implements. The node agent daemon drives it; it never
imports Django (it runs on GPU hosts with a slim install).

Payload shapes are the agent protocol's (docs/agent-protocol.md):

- a worker: ``{"worker": name, "job": id, "group": name, "kind": "rollout", "tp": 1, "pp": 1,
  "devices": [{"uid": "host/gpu0", "index": 0, "hardware": "H100", "shared": false}]}``; ``shared``
  marks a device the worker time-shares with other workers of its job (a colocated placement)
- a migration step: the command payload ``{"migration", "job", "attempt", "is_rollback",
  "step": PlannedStep JSON (step_id, kind, group_id, strategy, device_ids, worker_ids, ...),
  "handover": {...}}`` where ``handover`` carries what an earlier step produced for this one
  (e.g. the requests ``take_back_requests`` took from paused donors, for ``redistribute_requests``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this host now (e.g. its cluster cannot be reached); the message
    says why and what was tried. The agent exits with it instead of starting half-way."""


class StepFailed(Exception):
    """The backend could not carry a step out; the message goes into the report."""


def local_device_index(uid: str, host: str, device_count: int) -> int | None:
    """The index on ``host`` of the device the control plane calls ``uid`` (``host/gpuN``), or
    None when the device is another host's or not one of its ``device_count`` devices."""
    owner, _, rest = uid.rpartition("/")
    if owner != host or not rest.startswith("gpu") or not rest[3:].isdigit():
        return None
    index = int(rest[3:])
    return index if index < device_count else None


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator as the agent registers it."""

    index: int
    hardware: str
    memory_gb: float

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "hardware": self.hardware, "memory_gb": self.memory_gb}


@dataclass(frozen=True)
class DeviceReading:
    index: int
    utilisation: float  # 0..1
    memory_used_gb: float
    # What measured it (the heartbeat's devices[].source): "simulated", or "process_cpu" for the CPU
    # share of the worker processes holding the device (a host without NVML; the agent's own NVML
    # readings, "nvml", replace a backend's where present).
    source: str

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "utilisation": self.utilisation,
            "memory_used_gb": self.memory_used_gb,
            "source": self.source,
        }


@dataclass(frozen=True)
class WorkerReading:
    """One telemetry sample of one worker (the heartbeat's ``workers[]`` entries)."""

    worker: str
    at: float  # the agent's clock, epoch seconds
    utilisation: float
    queue_length: int = 0
    in_flight: int = 0
    tokens: int = 0  # produced (or trained on) since the previous sample
    progress: float | None = None
    # Only for a worker time-sharing its devices (colocated): "active", "onloading" or "offloaded".
    turn: str | None = None
    # The share of the time since the previous sample it sat idle waiting for input (a trainer
    # rank waiting for the next batch); None where the backend does not measure it.
    waiting: float | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "worker": self.worker,
            "at": self.at,
            "utilisation": self.utilisation,
            "queue_length": self.queue_length,
            "in_flight": self.in_flight,
            "tokens": self.tokens,
        }
        if self.progress is not None:
            data["progress"] = self.progress
        if self.turn is not None:
            data["turn"] = self.turn
        if self.waiting is not None:
            data["waiting"] = self.waiting
        return data


@dataclass
class Telemetry:
    devices: list[DeviceReading] = field(default_factory=list)
    workers: list[WorkerReading] = field(default_factory=list)
    # Per-job progress the backend reports (iteration counters); see docs/agent-protocol.md.
    jobs: list[dict[str, Any]] = field(default_factory=list)


class ExecutionBackend(Protocol):
    name: str

    def inventory(self) -> Sequence[DeviceInfo]:
        """The host's accelerators, registered with the control plane."""
        ...

    def launch_workers(self, job: Mapping[str, Any], workers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Start workers of a job (``job`` is the launch payload: id and spec). Idempotent by worker name."""
        ...

    def stop_workers(
        self, job_id: int, worker_names: Sequence[str], *, redo_from_iteration: int | None = None
    ) -> dict[str, Any]:
        """Stop workers; stopping one that is not running is not an error. ``redo_from_iteration``:
        the job is being placed anew and these are all its workers here, so what this node did of
        that iteration and later is void (the new layout's workers redo it from the start)."""
        ...

    def execute_step(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Carry out this node's part of one migration step; raise StepFailed to report a failure.
        Must be idempotent by ``payload["step"]["step_id"]`` and attempt."""
        ...

    def telemetry(self) -> Telemetry:
        """What happened since the last call."""
        ...

    def observe_control(self, reply: Mapping[str, Any]) -> None:
        """The control plane's heartbeat reply (job progress, membership); backends may ignore it."""
        ...

    def running_workers(self) -> Sequence[str]:
        """Names of the workers this host runs now (for reconciliation after a restart)."""
        ...

    def close(self) -> None:
        """Stop everything; called once when the agent exits."""
        ...


@runtime_checkable
class ReconcilingBackend(Protocol):
    """Optional: a backend whose workers can outlive the agent process (e.g. Ray actors) says
    itself how to match what the control plane expects after the agent registers again."""

    def reconcile(self, workers: Sequence[Mapping[str, Any]], jobs: Mapping[str, Any]) -> dict[str, Any]:
        """Run exactly ``workers`` (the registration reply's ``workers``: worker payloads with their
        ``state``, starting or running) and stop any other; ``jobs`` maps job ids (strings) to
        their specs. Returns ``{"stopped": [names], "relaunched": [names]}``. Without this method
        the daemon stops the extra workers and launches again the running ones the backend lacks."""
        ...


def steps_outlive_agent(backend: ExecutionBackend) -> bool:
    """Whether the backend's migration steps run on in workers that outlive its agent
    (``resumes_interrupted_steps``): a restarted agent then carries an interrupted step out again,
    and the control plane waits for it at a point of no return rather than roll back a step that
    may have taken effect."""
    return bool(getattr(backend, "resumes_interrupted_steps", False))
