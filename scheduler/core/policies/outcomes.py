"""Do no harm, move by move: what each kind of move was predicted to gain against what it gained.

A move is chosen for the throughput the pace model predicts its recipient will reach with the
GPUs (the predictor's rate at the new size, against the old). Once the move has landed and the
telemetry has had a signal window to show the recipient at work with them, its measured
throughput is held against that prediction: the move *gained* the measured rise over the
predicted rise. This is the control plane's predictor error (``scheduler.services.
predictor_errors``) taken to the level the policy decides on. Per kind of move (which kind of
group gave to which; a re-planned base split is judged by its next iteration instead),
``MoveOutcomes`` keeps the smoothed ratio of gained to predicted:

- a kind whose moves gain less than predicted is trusted less: its candidates' predicted gains
  are scaled by the ratio before they face ``min_gain_ratio``;
- a kind whose moves lose (the ratio at or under zero, over at least ``MIN_OUTCOMES``) stops
  being made for ``probation_iterations`` iterations, then gets one fresh trial, since the job
  may have changed.

A move whose iteration ends before it could be measured leaves no outcome, nor does one whose
recipient, in a synchronous iteration, finished its share of the iteration or gave up its GPUs by
then: its throughput over a window it spent partly idle says when its input ran out, not what the
GPUs added, and its GPUs went on to the trainer. (A recipient short of input while it still has
work left, or waiting for an asynchronous job's next batch, is what the record is for.)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
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
    recipient: str
    measured_before: float  # the recipient's tokens/s when the move was decided
    predicted_rise: float  # tokens/s the move was predicted to add to the recipient
    measure_after: float  # when the move has landed and a signal window has seen it
    opened_at: float = 0.0  # when the move was decided

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class KindRecord:
    outcomes: int = 0
    ratio: float = 1.0  # smoothed gained / predicted
    suspended_until: int | None = None  # iteration from which the kind may be tried again
    suspensions: int = 0


class MoveOutcomes:
    def __init__(self, probation_iterations: int) -> None:
        self.probation = probation_iterations
        self.open: list[OpenOutcome] = []
        self.kinds: dict[str, KindRecord] = {}

    def opened(self, outcome: OpenOutcome) -> None:
        if outcome.predicted_rise > 0:
            self.open.append(outcome)

    def settle(
        self, now: float, measured: Mapping[str, float], iteration: int, finished: Collection[str] = ()
    ) -> None:
        """Hold the moves due at ``now`` against their recipients' ``measured`` tokens/s; those
        whose recipient is in ``finished`` (done with the iteration, or emptied) leave nothing."""
        still: list[OpenOutcome] = []
        for outcome in self.open:
            if outcome.recipient in finished:
                continue
            rate = measured.get(outcome.recipient)
            if now < outcome.measure_after or rate is None:
                still.append(outcome)
                continue
            self.record(outcome.kind, (rate - outcome.measured_before) / outcome.predicted_rise, iteration)
        self.open = still

    def cancel(self, recipient: str, opened_at: float) -> None:
        """The move to ``recipient`` decided at ``opened_at`` was never carried out: it leaves no
        outcome (what its recipient goes on to measure says nothing about it)."""
        self.open = [o for o in self.open if not (o.recipient == recipient and o.opened_at == opened_at)]

    def drop_open(self) -> None:
        """The iteration ended: moves not measured yet leave no outcome (their recipients' work
        is over, so what they would show says nothing about the move)."""
        self.open = []

    def record(self, kind: str, ratio: float, iteration: int) -> None:
        """Fold one outcome (gained over predicted) into ``kind``'s record."""
        ratio = min(max(ratio, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])
        record = self.kinds.setdefault(kind, KindRecord())
        record.ratio = ratio if record.outcomes == 0 else SMOOTHING * ratio + (1 - SMOOTHING) * record.ratio
        record.outcomes += 1
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
                    f"{kind} moves did not pay on this job (their recipients gained "
                    f"{record.ratio:.0%} of the predicted throughput over {record.outcomes} moves); "
                    f"not tried again before iteration {record.suspended_until}"
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
            OpenOutcome(
                str(o["kind"]),
                str(o["recipient"]),
                float(o["measured_before"]),
                float(o["predicted_rise"]),
                float(o["measure_after"]),
                float(o.get("opened_at", 0.0)),
            )
            for o in data.get("open", [])
        ]
        self.kinds = {}
        for kind, record in data.get("kinds", {}).items():
            until = record.get("suspended_until")
            self.kinds[str(kind)] = KindRecord(
                outcomes=int(record.get("outcomes", 0)),
                ratio=float(record.get("ratio", 1.0)),
                suspended_until=None if until is None else int(until),
                suspensions=int(record.get("suspensions", 0)),
            )
