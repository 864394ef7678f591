"""Hand-built hypergraphs, signals and predictors shared by the policy tests (no tests here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from scheduler.core.costs import MigrationCostModel
from scheduler.core.hypergraph import ComponentKind, Device, Hypergraph, HyperNode, Parallelism, Worker
from scheduler.core.policies import SchedulingPolicy, build_policy
from scheduler.core.predictor import ThroughputPredictor
from scheduler.core.signals import GroupSignals


def make_group(
    group_id: str,
    kind: ComponentKind,
    workers: int,
    *,
    first_device: int,
    gpus_per_worker: int = 1,
    hardware: str = "H100",
    node: str = "n0",
    utilisation: Sequence[float] | None = None,
    **fields: Any,
) -> HyperNode:
    """``workers`` workers named ``{group_id}-w{i}`` on devices ``{node}-g{first_device + ...}``."""
    built = []
    for i in range(workers):
        devices = tuple(
            Device(id=f"{node}-g{first_device + i * gpus_per_worker + j}", node=node, hardware=hardware)
            for j in range(gpus_per_worker)
        )
        built.append(
            Worker(id=f"{group_id}-w{i}", devices=devices, utilisation=utilisation[i] if utilisation else 0.5)
        )
    parallelism = fields.pop("parallelism", Parallelism(tp=gpus_per_worker))
    return HyperNode(id=group_id, kind=kind, workers=tuple(built), parallelism=parallelism, **fields)


def make_graph(*nodes: HyperNode, iteration: int = 0) -> Hypergraph:
    return Hypergraph(job_id="job-1", nodes=tuple(nodes), iteration=iteration)


def make_signals(node: HyperNode, *, idle: int = 0, window_s: float = 10.0, **fields: Any) -> GroupSignals:
    """Signals where the first ``idle`` workers (lowest first) stayed under U_low all window."""
    idle_ids = tuple(w.id for w in node.workers[:idle])
    fraction = idle / len(node.workers) if node.workers else 0.0
    defaults: dict[str, Any] = {
        "low_utilisation_fraction": fraction,
        "low_utilisation_workers": idle_ids,
        "busy": True,
    }
    defaults.update(fields)
    return GroupSignals(group_id=node.id, at=0.0, window_s=window_s, workers=len(node.workers), **defaults)


def linear_profiles(
    per_gpu: Mapping[str, float], sizes: Sequence[int] = (1, 2, 4, 8, 16, 32)
) -> ThroughputPredictor:
    """A predictor whose groups (or kinds) deliver ``per_gpu`` tokens/s per GPU, linearly."""
    return ThroughputPredictor({key: [(g, rate * g) for g in sizes] for key, rate in per_gpu.items()})


def make_policy(
    name: str,
    predictor: ThroughputPredictor | None = None,
    *,
    model_params_b: float = 7.0,
    **params: Any,
) -> SchedulingPolicy:
    return build_policy(
        name,
        predictor=predictor or linear_profiles({"rollout": 1000.0, "actor": 100.0}),
        cost_model=MigrationCostModel(model_params_b=model_params_b),
        params=params,
    )


def devices_of(node: HyperNode, worker_indexes: Sequence[int]) -> set[str]:
    return {d.id for i in worker_indexes for d in node.workers[i].devices}


def free_devices(count: int, *, first: int = 100, hardware: str = "H100", node: str = "n9") -> list[Device]:
    return [Device(id=f"{node}-g{first + i}", node=node, hardware=hardware) for i in range(count)]


def land(graph: Hypergraph, decisions: Sequence[Any]) -> Hypergraph:
    """The graph once ``decisions`` have been carried out, as an executor would."""
    from scheduler.core.policies.moves import apply_move

    devices = {d.id: d for n in graph.nodes for w in n.workers for d in w.devices}
    for decision in decisions:
        moved = [devices.get(d) or Device(id=d, node="n9", hardware="H100") for d in decision.device_ids]
        graph = apply_move(graph, decision.donor, decision.recipient, moved)
    return graph
