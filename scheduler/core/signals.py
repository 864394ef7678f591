"""Per-WorkerGroup signals: the aggregates the policies read (never per-GPU detail)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from scheduler.core.hypergraph import ComponentKind


@dataclass(frozen=True)
class GroupSignals:
    """Aggregates of one WorkerGroup over a sliding window ending at ``at``."""

    group_id: str
    at: float
    window_s: float
    workers: int
    utilisation_mean: float = 0.0
    utilisation_p50: float = 0.0
    utilisation_p90: float = 0.0
    utilisation_p99: float = 0.0
    low_utilisation_fraction: float = 0.0  # workers under U_low for the whole window / workers
    low_utilisation_workers: tuple[str, ...] = ()  # the ids of those workers, lowest first
    queue_length: int = 0  # requests waiting, not yet on a worker
    in_flight: int = 0  # requests running on the group's workers
    max_in_flight_per_worker: int = 0  # engine concurrency (e.g. SGLang max_running_requests)
    tokens_per_s: float = 0.0
    progress: float = 0.0  # 0..1 of the group's work in the current iteration
    busy: bool = True  # False when the group has nothing to do in this phase

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["low_utilisation_workers"] = list(self.low_utilisation_workers)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupSignals:
        return cls(**{**data, "low_utilisation_workers": tuple(data["low_utilisation_workers"])})


@dataclass(frozen=True)
class WorkerSample:
    """One telemetry sample of one worker, as an agent or the simulator reports it."""

    group_id: str
    worker_id: str
    at: float
    utilisation: float  # 0..1
    queue_length: int = 0
    in_flight: int = 0
    tokens: int = 0  # tokens produced (or trained on) since the worker's previous sample
    progress: float | None = None  # the group's progress as this worker sees it, 0..1


@dataclass(frozen=True)
class MeasuredIteration:
    """One iteration as the job's own driver measured it, phase by phase: what a real runtime
    reports at the end of each iteration. The ticks' signals are windowed over seconds, too
    coarse for an iteration of a few; where this exists, a policy re-plans from it instead.

    ``busy_s``: seconds each pipeline group kind worked ("inference": log-probs; "actor": the
    train step and the weight push), after the rollout generated for ``generate_s``."""

    iteration: int
    duration_s: float  # from the previous iteration's end to this one's, a re-placement excluded
    generate_s: float
    busy_s: Mapping[ComponentKind, float]
    tokens: float  # tokens the trainer trained
