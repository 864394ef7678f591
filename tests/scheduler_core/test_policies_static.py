import pytest

from scheduler.core.hypergraph import ComponentKind
from scheduler.core.policies import Placement
from tests.scheduler_core.test_policies_fixtures import (
    free_devices,
    make_graph,
    make_group,
    make_policy,
    make_signals,
)


@pytest.mark.parametrize(
    "name, placement",
    [("static-colocated", Placement.COLOCATED), ("static-disaggregated", Placement.DISAGGREGATED)],
)
def test_static_policies_never_move_anything(name: str, placement: Placement) -> None:
    rollout = make_group("rollout", ComponentKind.ROLLOUT, 8, first_device=0)
    actor = make_group("actor", ComponentKind.ACTOR, 4, first_device=50)
    graph = make_graph(rollout, actor)
    # Signals that make every dynamic policy move: a drained rollout and a backed-up actor.
    signals = {
        "rollout": make_signals(rollout, idle=7, in_flight=1, max_in_flight_per_worker=4),
        "actor": make_signals(actor, queue_length=10, progress=0.3),
    }
    policy = make_policy(name)
    assert policy.placement is placement
    assert make_policy("dynarl").decide(graph, signals, free_devices(4), now=0.0)  # the scene does trigger
    for now in (0.0, 30.0, 60.0):
        assert policy.decide(graph, signals, free_devices(4), now=now) == []
        assert policy.idle_note == f"{name} never moves GPUs: the placement stays as the job started"
    assert policy.on_iteration_end(graph, now=90.0) == []
    assert policy.plan_initial_split(12, [rollout, actor]) is None


@pytest.mark.parametrize("name", ["static-colocated", "static-disaggregated"])
def test_static_policies_take_no_parameters(name: str) -> None:
    with pytest.raises(ValueError, match="unknown parameter 'u_low'"):
        make_policy(name, u_low=0.2)
