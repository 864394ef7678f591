"""A migration step command's payload, decoded the same way by every backend (docs/agent-protocol.md,
``migration_step``; the step kinds are in docs/migration-plans.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agents.backends.base import StepFailed


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


def parse_step(payload: Mapping[str, Any]) -> StepContext:
    """The step a ``migration_step`` command carries; StepFailed names what is malformed."""
    step = payload.get("step")
    if not isinstance(step, Mapping):
        raise StepFailed("the step payload has no 'step' object")
    try:
        handover = payload.get("handover") or {}
        return StepContext(
            step_id=str(step["step_id"]),
            attempt=int(payload.get("attempt", 1)),
            kind=str(step["kind"]),
            job_id=int(payload["job"]),
            group=str(step["group_id"]),
            strategy=str(step.get("strategy", "")),
            worker_ids=tuple(str(w) for w in step.get("worker_ids", ())),
            device_ids=tuple(str(d) for d in step.get("device_ids", ())),
            handover=handover if isinstance(handover, Mapping) else {},
            spec=payload["spec"] if isinstance(payload.get("spec"), Mapping) else None,
            share=float(step.get("share", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StepFailed(f"malformed step payload: {exc!r}") from exc
