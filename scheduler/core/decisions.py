"""What a policy returns, and the interface every policy implements."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Protocol

from scheduler.core.hypergraph import Device, Hypergraph, MigrationStrategy
from scheduler.core.signals import GroupSignals


class Reason(StrEnum):
    """Machine-readable reasons; ``Decision.detail`` carries the human sentence."""

    DONOR_LOW_UTILISATION = "donor_low_utilisation"  # Algorithm 1 trigger
    RELEASE_UNNEEDED_ROLLOUT = "release_unneeded_rollout"  # rlinf-auto
    RESTORE_AT_ITERATION_END = "restore_at_iteration_end"
    BORROW_IDLE_POOL = "borrow_idle_pool"  # bidirectional
    RETURN_BORROWED = "return_borrowed"
    GROW_INTO_FREE_DEVICES = "grow_into_free_devices"
    PHASE_SWITCH = "phase_switch"  # static-colocated time-sharing
    REPLAN_BASE_SPLIT = "replan_base_split"  # dynarl: the next iteration's split, from measurements
    OPERATOR_REQUEST = "operator_request"


@dataclass(frozen=True)
class Prediction:
    """Predicted throughput (tokens/s) before and after a candidate move."""

    donor_before: float
    donor_after: float
    recipient_before: float
    recipient_after: float
    job_before: float
    job_after: float

    @property
    def gain(self) -> float:
        return self.job_after - self.job_before

    def to_json(self) -> dict[str, float]:
        return {
            "donor_before": self.donor_before,
            "donor_after": self.donor_after,
            "recipient_before": self.recipient_before,
            "recipient_after": self.recipient_after,
            "job_before": self.job_before,
            "job_after": self.job_after,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Prediction:
        return cls(**{f.name: float(data[f.name]) for f in fields(cls)})


@dataclass(frozen=True)
class Candidate:
    """One move a policy weighed."""

    donor: str | None  # group id, None when taking free devices
    recipient: str | None  # group id, None when releasing to the free pool
    device_ids: tuple[str, ...]
    prediction: Prediction | None
    migration_cost_s: float
    score: float
    rejected_because: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "donor": self.donor,
            "recipient": self.recipient,
            "device_ids": list(self.device_ids),
            "prediction": self.prediction.to_json() if self.prediction else None,
            "migration_cost_s": self.migration_cost_s,
            "score": self.score,
            "rejected_because": self.rejected_because,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Candidate:
        prediction = data.get("prediction")
        return cls(
            donor=data["donor"],
            recipient=data["recipient"],
            device_ids=tuple(data["device_ids"]),
            prediction=Prediction.from_json(prediction) if prediction else None,
            migration_cost_s=float(data["migration_cost_s"]),
            score=float(data["score"]),
            rejected_because=data.get("rejected_because"),
        )


@dataclass(frozen=True)
class Decision:
    """Move ``device_ids`` from ``donor`` to ``recipient`` (either may be None: the free pool)."""

    policy: str
    reason: Reason
    detail: str
    donor: str | None
    recipient: str | None
    device_ids: tuple[str, ...]
    donor_strategy: MigrationStrategy | None
    recipient_strategy: MigrationStrategy | None
    chosen: Candidate | None = None
    candidates: tuple[Candidate, ...] = field(default_factory=tuple)
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "reason": self.reason.value,
            "detail": self.detail,
            "donor": self.donor,
            "recipient": self.recipient,
            "device_ids": list(self.device_ids),
            "donor_strategy": self.donor_strategy.value if self.donor_strategy else None,
            "recipient_strategy": self.recipient_strategy.value if self.recipient_strategy else None,
            "chosen": self.chosen.to_json() if self.chosen else None,
            "candidates": [c.to_json() for c in self.candidates],
            "at": self.at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Decision:
        chosen = data.get("chosen")
        return cls(
            policy=data["policy"],
            reason=Reason(data["reason"]),
            detail=data["detail"],
            donor=data["donor"],
            recipient=data["recipient"],
            device_ids=tuple(data["device_ids"]),
            donor_strategy=_strategy(data.get("donor_strategy")),
            recipient_strategy=_strategy(data.get("recipient_strategy")),
            chosen=Candidate.from_json(chosen) if chosen else None,
            candidates=tuple(Candidate.from_json(c) for c in data.get("candidates", ())),
            at=float(data.get("at", 0.0)),
        )


def _strategy(value: str | None) -> MigrationStrategy | None:
    return MigrationStrategy(value) if value else None


class Policy(Protocol):
    """(hypergraph, signals, free devices, now) -> decisions, each with its reason."""

    name: str

    def decide(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        free_devices: Sequence[Device],
        now: float,
    ) -> list[Decision]: ...
