"""What one simulated run reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

# Measured on the machine running the simulator, not in virtual time: excluded from the
# deterministic part of a result.
WALL_CLOCK_FIELDS = frozenset({"decision_latency_p50_ms", "decision_latency_p99_ms", "wall_s"})


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


@dataclass(frozen=True)
class MoveRecord:
    """One applied decision, from the donor letting go to the recipient running."""

    at: float
    reason: str
    donor: str | None
    recipient: str | None
    gpus: int
    donor_cost_s: float
    recipient_cost_s: float
    requests_taken_back: int
    iteration: int


@dataclass(frozen=True)
class PlacementChangeRecord:
    """A re-planning policy's switch of placement at an iteration boundary."""

    at: float
    iteration: int  # the first iteration run under the new placement
    to: str
    cost_s: float
    why: str


@dataclass(frozen=True)
class SimResult:
    workload: str
    policy: str
    placement: str
    gpus: int
    iterations: int
    staleness_bound: int
    router_mode: str
    initial_split: dict[str, int]
    split_note: str
    makespan_s: float
    tokens: int  # trained tokens: prompt, responses and tool outputs of every sample
    generated_tokens: int
    tokens_per_s: float
    iteration_end_s: tuple[float, ...]
    migrations: int
    moves_by_reason: dict[str, int]
    moves: tuple[MoveRecord, ...]
    decisions: int
    rejected_by_problem: dict[str, int]
    migration_gpu_s: float  # GPU-seconds in transit or paused by migrations
    online_overhead: float  # migration_gpu_s / (GPUs * makespan)
    colocate_switch_s: float
    max_staleness: int
    mean_staleness: float
    retractions: int
    reprefilled_tokens: int
    affinity_hits: int
    requests_dispatched: int
    done_by_60pct_of_last: tuple[float, ...]  # per iteration: share of episodes done by 60% of the last
    gpu_seconds: dict[str, float]  # where the GPU-time went, by kind (simulator.GPU_TIME_KINDS)
    gpu_seconds_by_iteration: tuple[dict[str, float], ...]  # the same, per iteration being trained
    decision_latency_p50_ms: float
    decision_latency_p99_ms: float
    decision_calls: int
    wall_s: float
    placements: tuple[str, ...] = ()  # per iteration, the placement it ran under
    placement_changes: tuple[PlacementChangeRecord, ...] = ()

    def to_dict(self, *, include_wall_clock: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; without wall-clock measurements it is a pure function of the inputs."""
        data = asdict(self)
        if not include_wall_clock:
            for name in WALL_CLOCK_FIELDS:
                del data[name]
        return data

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
