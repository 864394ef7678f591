"""Do no harm, move by move: what each kind of move was predicted to gain against what it gained.

A move is weighed by the pace model: the job's predicted end of the iteration without it
(``base_end``) against with it, net of its cost at the cost model's figures (which the control
plane scales by the job's measured migration durations). When the iteration ends, the moves made
in it are held against the measured end: together they gained ``base_end`` of the first of them
minus the time the iteration really ended, against the sum of their predicted gains. The moves of
one iteration act on the same end and cannot be told apart from it, so that ratio is credited to
every kind of move (which kind of group gave to which) that acted in it. ``MoveOutcomes`` keeps
each kind's smoothed ratio of gained to predicted:

- a kind whose moves gain less than predicted is trusted less: its candidates' predicted gains
  are scaled by the ratio before they face ``min_gain_ratio``;
- a kind whose moves lose (the ratio at or under zero, over at least ``MIN_OUTCOMES``) stops
  being made for ``probation_iterations`` iterations, then gets one fresh trial, since the job
  may have changed.

The control plane's predictor-error rows compare each group's predicted throughput with the one
measured after a move; this is the same idea at the level the policy decides on (the job's end).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from scheduler.core.hypergraph import HyperNode

MIN_OUTCOMES = 3  # iterations a kind acted in before its record counts
SMOOTHING = 0.5  # weight of the newest outcome
RATIO_BOUNDS = (-3.0, 3.0)


def move_kind(donor: HyperNode | None, recipient: HyperNode) -> str:
    """``rollout>actor``, ``free>rollout``: the kinds of group a move takes from and gives to."""
    return f"{donor.kind.value if donor is not None else 'free'}>{recipient.kind.value}"


@dataclass(frozen=True)
class OpenOutcome:
    kind: str
    predicted_gain_s: float
    base_end: float  # the predicted end of the iteration without the move, when it was decided

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class KindRecord:
    outcomes: int = 0
    ratio: float = 1.0  # smoothed gained / predicted
    losing: int = 0  # outcomes in a row that lost time
    suspended_until: int | None = None  # iteration from which the kind may be tried again
    suspensions: int = 0


class MoveOutcomes:
    def __init__(self, probation_iterations: int) -> None:
        self.probation = probation_iterations
        self.open: list[OpenOutcome] = []
        self.kinds: dict[str, KindRecord] = {}

    def opened(self, kind: str, predicted_gain_s: float, base_end: float) -> None:
        if predicted_gain_s > 0:
            self.open.append(OpenOutcome(kind, predicted_gain_s, base_end))

    def settle(self, end: float, iteration: int) -> None:
        """The iteration ended at ``end``: hold its moves against it."""
        if not self.open:
            return
        predicted = sum(o.predicted_gain_s for o in self.open)
        gained = self.open[0].base_end - end
        ratio = gained / predicted
        for kind in sorted({o.kind for o in self.open}):
            self.record(kind, ratio, iteration)
        self.open = []

    def record(self, kind: str, ratio: float, iteration: int) -> None:
        """Fold one outcome (gained over predicted) into ``kind``'s record."""
        ratio = min(max(ratio, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])
        record = self.kinds.setdefault(kind, KindRecord())
        record.ratio = ratio if record.outcomes == 0 else SMOOTHING * ratio + (1 - SMOOTHING) * record.ratio
        record.outcomes += 1
        record.losing = record.losing + 1 if ratio <= 0 else 0
        if record.outcomes >= MIN_OUTCOMES and record.ratio <= 0:
            record.suspended_until = iteration + self.probation
            record.suspensions += 1

    def trust(self, kind: str, iteration: int) -> tuple[float, str | None]:
        """The factor on this kind's predicted gains, and why it may not be made at all."""
        record = self.kinds.get(kind)
        if record is None:
            return 1.0, None
        if record.suspended_until is not None:
            if iteration < record.suspended_until:
                return 0.0, (
                    f"{kind} moves lost time on this job (gained {record.ratio:.0%} of their "
                    f"predicted gain over {record.outcomes}); not tried again before iteration "
                    f"{record.suspended_until}"
                )
            # Probation is over: one fresh trial, judged on its own.
            self.kinds[kind] = KindRecord(suspensions=record.suspensions)
            return 1.0, None
        if record.outcomes < MIN_OUTCOMES:
            return 1.0, None
        return min(1.0, max(0.0, record.ratio)), None

    def to_json(self) -> dict[str, Any]:
        return {
            "open": [o.to_json() for o in self.open],
            "kinds": {kind: asdict(record) for kind, record in self.kinds.items()},
        }

    def load(self, data: Mapping[str, Any]) -> None:
        self.open = [
            OpenOutcome(str(o["kind"]), float(o["predicted_gain_s"]), float(o["base_end"]))
            for o in data.get("open", [])
        ]
        self.kinds = {}
        for kind, record in data.get("kinds", {}).items():
            until = record.get("suspended_until")
            self.kinds[str(kind)] = KindRecord(
                outcomes=int(record.get("outcomes", 0)),
                ratio=float(record.get("ratio", 1.0)),
                losing=int(record.get("losing", 0)),
                suspended_until=None if until is None else int(until),
                suspensions=int(record.get("suspensions", 0)),
            )
