"""The two static baselines: they never move a GPU once the job runs."""

from __future__ import annotations

from scheduler.core.policies.base import BasePolicy, Placement


class _Static(BasePolicy):
    @property
    def idle_note(self) -> str:
        return f"{self.name} never moves GPUs: the placement stays as the job started"


class StaticColocatedPolicy(_Static):
    """verl-like: every component time-shares all of the job's GPUs, stage by stage.

    The phase switches are the placement's doing (the simulator or backend runs the stages in
    turn on all GPUs); the policy itself never moves anything. No parameters.
    """

    name = "static-colocated"
    placement = Placement.COLOCATED


class StaticDisaggregatedPolicy(_Static):
    """RLinf / AReaL-like fixed split: each group keeps the GPUs the job spec gave it.

    No parameters.
    """

    name = "static-disaggregated"
    placement = Placement.DISAGGREGATED
