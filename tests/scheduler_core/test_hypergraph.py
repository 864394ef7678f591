import dataclasses
import json

import pytest

from scheduler.core.hypergraph import (
    SCHEMA_VERSION,
    ComponentKind,
    Device,
    HyperEdge,
    Hypergraph,
    HyperNode,
    Interruptibility,
    MigrationStrategy,
    Parallelism,
    Scaling,
    SnapshotVersionError,
    Worker,
)


def _device(node: str, index: int, hardware: str = "H100") -> Device:
    return Device(id=f"{node}-gpu{index}", node=node, hardware=hardware, memory_gb=141.0)


def _full_graph() -> Hypergraph:
    """Every field of every dataclass set to something other than its default."""
    rollout = HyperNode(
        id="rollout",
        kind=ComponentKind.ROLLOUT,
        workers=(
            Worker(id="rollout-w0", devices=(_device("n0", 0),), utilisation=0.75),
            Worker(id="rollout-w1", devices=(_device("n0", 1, "H200"),), utilisation=0.125),
        ),
        scaling=Scaling.STATIC,  # not the kind's default
        depends_on=("actor",),
        interruptibility=Interruptibility.ITERATION,
        parallelism=Parallelism(tp=1, pp=1, valid_dp=(1, 2, 4)),
        min_workers=0,
        max_workers=8,
        hardware_affinity=("H200", "H100"),
    )
    actor = HyperNode(
        id="actor",
        kind=ComponentKind.ACTOR,
        workers=(Worker(id="actor-w0", devices=(_device("n1", 0), _device("n1", 1)), utilisation=0.5),),
        scaling=Scaling.DYNAMIC,
        depends_on=("rollout", "reward"),
        interruptibility=Interruptibility.NEVER,
        parallelism=Parallelism(tp=2, pp=1, valid_dp=(1, 2)),
        min_workers=2,
        max_workers=4,
        hardware_affinity=("H100",),
    )
    reward = HyperNode(id="reward", kind=ComponentKind.REWARD, min_workers=3)
    edge = HyperEdge(
        id="rollout->actor",
        source="rollout",
        target="actor",
        items_total=512,
        items_produced=300,
        items_consumed=128,
        affinity={"ep-2": "rollout-w1", "ep-1": "rollout-w0"},
    )
    return Hypergraph(
        job_id="job-7",
        nodes=(rollout, actor, reward),
        edges=(edge,),
        iteration=12,
        policy_version=11,
        taken_at=1234.5,
    )


def test_json_round_trip_is_exact() -> None:
    graph = _full_graph()
    assert Hypergraph.from_json(graph.to_json()) == graph
    assert Hypergraph.from_json(json.loads(json.dumps(graph.to_json()))) == graph


def test_full_graph_really_sets_non_defaults() -> None:
    # Guards the round-trip test: a field left at its default would not prove it is serialised.
    graph = _full_graph()
    defaults = Hypergraph(job_id="", nodes=())
    for name in ("iteration", "policy_version", "taken_at"):
        assert getattr(graph, name) != getattr(defaults, name)
    rollout = graph.node("rollout")
    default_rollout = HyperNode(id="rollout", kind=ComponentKind.ROLLOUT)
    for f in dataclasses.fields(HyperNode):
        if f.name not in ("id", "kind"):
            assert getattr(rollout, f.name) != getattr(default_rollout, f.name), f.name


def test_json_is_deterministic() -> None:
    graph = _full_graph()
    assert json.dumps(graph.to_json()) == json.dumps(Hypergraph.from_json(graph.to_json()).to_json())
    assert list(graph.to_json()["edges"][0]["affinity"]) == ["ep-1", "ep-2"]


@pytest.mark.parametrize("version", [None, 0, SCHEMA_VERSION + 1, "1"])
def test_wrong_schema_version_is_refused(version: object) -> None:
    data = _full_graph().to_json()
    if version is None:
        del data["schema_version"]
    else:
        data["schema_version"] = version
    with pytest.raises(SnapshotVersionError):
        Hypergraph.from_json(data)


def test_kind_defaults_are_filled() -> None:
    node = HyperNode(id="actor", kind=ComponentKind.ACTOR)
    assert node.scaling is Scaling.STATIC
    assert node.interruptibility is Interruptibility.MICROBATCH
    assert node.strategy is MigrationStrategy.P2P
    rollout = HyperNode(id="r", kind=ComponentKind.ROLLOUT)
    assert rollout.is_dynamic
    assert rollout.strategy is MigrationStrategy.WORKLOAD
    assert HyperNode(id="t", kind=ComponentKind.TOOL).strategy is MigrationStrategy.RESTART


def test_node_helpers() -> None:
    graph = _full_graph()
    actor = graph.node("actor")
    assert actor.gpus == 2
    assert actor.device_ids == ("n1-gpu0", "n1-gpu1")
    assert actor.parallelism.gpus_per_worker == 2
    assert actor.accepts_hardware("H100")
    assert not actor.accepts_hardware("H200")
    assert HyperNode(id="x", kind=ComponentKind.TOOL).accepts_hardware("anything")
    # min 2, max 4, valid_dp (1, 2): only 2 passes all three.
    assert [n for n in range(6) if actor.is_valid_worker_count(n)] == [2]
    assert graph.node("rollout").workers[1].hardware == "H200"
    assert graph.node("rollout").workers[1].node == "n0"
    assert Worker(id="empty", devices=()).node == ""


def test_graph_helpers() -> None:
    graph = _full_graph()
    assert graph.gpus == 4
    assert graph.by_kind(ComponentKind.ACTOR) == (graph.node("actor"),)
    assert graph.allocation()["rollout"] == ("n0-gpu0", "n0-gpu1")
    with pytest.raises(KeyError):
        graph.node("missing")
    smaller = graph.node("rollout").with_workers(graph.node("rollout").workers[:1])
    updated = graph.with_node(smaller)
    assert updated.node("rollout").gpus == 1
    assert graph.node("rollout").gpus == 2  # immutable: the original is unchanged
    assert [n.id for n in updated.nodes] == ["rollout", "actor", "reward"]


def test_edge_progress() -> None:
    edge = _full_graph().edges[0]
    assert edge.progress == pytest.approx(0.25)
    assert HyperEdge(id="e", source="a", target="b").progress == 0.0
