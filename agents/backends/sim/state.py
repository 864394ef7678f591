"""What a simulated host keeps about its devices, workers, episodes and jobs (``host.SimHost``).

Plain records, no behaviour beyond their own fields: ``host.py`` changes them as the host's events
run, ``telemetry.py`` reads them for samples, ``steps.py`` changes them for migration steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from agents.backends.sim.model import JobModel
from scheduler.core.sim.engine import Engine
from scheduler.core.sim.episodes import Episode
from scheduler.core.sim.hardware import HardwareSpec
from scheduler.core.sim.stages import GpuWorkerBase, LogProbWorker, SampleMark
from scheduler.core.sim.trace import TraceRecord

ACTIVE_JOB_STATES = ("admitted", "running", "paused_scheduling")


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
    """The control plane's picture of a job, from the heartbeat reply (``agents.services.progress``)."""

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
    """The gang's training of one whole iteration, as every host of the gang follows it: a fluid
    ``fraction`` done at ``1 / total_s`` per second (``stages.train_s`` for the gang's size), which
    a rank joining mid-iteration picks up from the reply's actor count. The core's ``Trainer``
    trains mini-batches as complete prompt groups arrive; counts alone do not tell a host that."""

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
