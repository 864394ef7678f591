"""The dynamic hypergraph of one RL job.

A HyperNode is one WorkerGroup (one component's workers); a HyperEdge is the data flow between
groups. The versioned JSON form is what PostgreSQL stores as a snapshot, so ``to_json`` and
``from_json`` must round-trip exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

SCHEMA_VERSION = 1


class ComponentKind(StrEnum):
    ROLLOUT = "rollout"
    INFERENCE = "inference"
    REWARD = "reward"
    TOOL = "tool"
    ACTOR = "actor"


class Scaling(StrEnum):
    """STATIC: throughput grows ~linearly with GPUs (the trainer).
    DYNAMIC: load shrinks by itself as work completes (rollout, inference)."""

    STATIC = "static"
    DYNAMIC = "dynamic"


class Interruptibility(StrEnum):
    """Where a group may be interrupted without breaking RL semantics."""

    ANY_REQUEST = "any_request"  # stateless serving: requests can be taken back at any time
    MICROBATCH = "microbatch"  # trainer: between micro-batches (state is consistent there)
    ITERATION = "iteration"  # only between RL iterations
    NEVER = "never"


class MigrationStrategy(StrEnum):
    RESTART = "restart"
    WORKLOAD = "workload"
    P2P = "p2p"


DEFAULT_SCALING: Mapping[ComponentKind, Scaling] = {
    ComponentKind.ROLLOUT: Scaling.DYNAMIC,
    ComponentKind.INFERENCE: Scaling.DYNAMIC,
    ComponentKind.REWARD: Scaling.STATIC,
    ComponentKind.TOOL: Scaling.STATIC,
    ComponentKind.ACTOR: Scaling.STATIC,
}

DEFAULT_INTERRUPTIBILITY: Mapping[ComponentKind, Interruptibility] = {
    ComponentKind.ROLLOUT: Interruptibility.ANY_REQUEST,
    ComponentKind.INFERENCE: Interruptibility.ANY_REQUEST,
    ComponentKind.REWARD: Interruptibility.ANY_REQUEST,
    ComponentKind.TOOL: Interruptibility.ANY_REQUEST,
    ComponentKind.ACTOR: Interruptibility.MICROBATCH,
}

DEFAULT_STRATEGY: Mapping[ComponentKind, MigrationStrategy] = {
    ComponentKind.ROLLOUT: MigrationStrategy.WORKLOAD,
    ComponentKind.INFERENCE: MigrationStrategy.WORKLOAD,
    ComponentKind.REWARD: MigrationStrategy.RESTART,
    ComponentKind.TOOL: MigrationStrategy.RESTART,
    ComponentKind.ACTOR: MigrationStrategy.P2P,
}


@dataclass(frozen=True)
class Device:
    """One accelerator on one node."""

    id: str
    node: str
    hardware: str
    memory_gb: float = 80.0
    index: int = 0  # position on its node (CUDA ordinal); with the node name, the global rank order

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "hardware": self.hardware,
            "memory_gb": self.memory_gb,
            "index": self.index,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Device:
        return cls(
            id=data["id"],
            node=data["node"],
            hardware=data["hardware"],
            memory_gb=float(data["memory_gb"]),
            index=int(data.get("index", 0)),
        )


@dataclass(frozen=True)
class Worker:
    """One worker (an engine replica or a trainer DP rank group) and the devices it holds."""

    id: str
    devices: tuple[Device, ...]
    utilisation: float = 0.0  # latest 0..1, for display; the policy reads GroupSignals

    @property
    def node(self) -> str:
        return self.devices[0].node if self.devices else ""

    @property
    def hardware(self) -> str:
        return self.devices[0].hardware if self.devices else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "devices": [d.to_json() for d in self.devices],
            "utilisation": self.utilisation,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Worker:
        return cls(
            id=data["id"],
            devices=tuple(Device.from_json(d) for d in data["devices"]),
            utilisation=float(data["utilisation"]),
        )


def largest_worker_count(
    fitting: int, *, min_workers: int, max_workers: int | None, valid_dp: tuple[int, ...]
) -> int:
    """The largest worker count, at most ``fitting``, within ``[min_workers, max_workers]`` and
    the valid data-parallel sizes (any when ``valid_dp`` is empty); 0 when there is none."""
    top = fitting if max_workers is None else min(fitting, max_workers)
    if valid_dp:
        return max((n for n in valid_dp if min_workers <= n <= top), default=0)
    return top if top >= max(1, min_workers) else 0


@dataclass(frozen=True)
class Parallelism:
    """Model parallelism of one worker (tp * pp GPUs) and the valid data-parallel sizes.

    ``valid_dp`` empty means any worker count between the group's min and max is valid.
    """

    tp: int = 1
    pp: int = 1
    valid_dp: tuple[int, ...] = ()

    @property
    def gpus_per_worker(self) -> int:
        return self.tp * self.pp

    def is_valid_worker_count(self, count: int) -> bool:
        return not self.valid_dp or count in self.valid_dp

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "valid_dp": list(self.valid_dp)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Parallelism:
        return cls(tp=int(data["tp"]), pp=int(data["pp"]), valid_dp=tuple(int(x) for x in data["valid_dp"]))


@dataclass(frozen=True)
class HyperNode:
    """A WorkerGroup: one component's workers."""

    id: str
    kind: ComponentKind
    workers: tuple[Worker, ...] = ()
    scaling: Scaling | None = None
    depends_on: tuple[str, ...] = ()
    interruptibility: Interruptibility | None = None
    parallelism: Parallelism = field(default_factory=Parallelism)
    min_workers: int = 1
    max_workers: int | None = None
    hardware_affinity: tuple[str, ...] = ()  # allowed hardware types, best first; empty = any

    def __post_init__(self) -> None:
        # Fill kind-derived defaults so the JSON form always carries explicit values.
        if self.scaling is None:
            object.__setattr__(self, "scaling", DEFAULT_SCALING[self.kind])
        if self.interruptibility is None:
            object.__setattr__(self, "interruptibility", DEFAULT_INTERRUPTIBILITY[self.kind])

    @property
    def is_dynamic(self) -> bool:
        return self.scaling is Scaling.DYNAMIC

    @property
    def strategy(self) -> MigrationStrategy:
        return DEFAULT_STRATEGY[self.kind]

    @property
    def gpus(self) -> int:
        return sum(len(w.devices) for w in self.workers)

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(d.id for w in self.workers for d in w.devices)

    def accepts_hardware(self, hardware: str) -> bool:
        return not self.hardware_affinity or hardware in self.hardware_affinity

    def is_valid_worker_count(self, count: int) -> bool:
        if count < self.min_workers:
            return False
        if self.max_workers is not None and count > self.max_workers:
            return False
        return self.parallelism.is_valid_worker_count(count)

    def with_workers(self, workers: Iterable[Worker]) -> HyperNode:
        return replace(self, workers=tuple(workers))

    def to_json(self) -> dict[str, Any]:
        assert self.scaling is not None and self.interruptibility is not None
        return {
            "id": self.id,
            "kind": self.kind.value,
            "scaling": self.scaling.value,
            "depends_on": list(self.depends_on),
            "interruptibility": self.interruptibility.value,
            "parallelism": self.parallelism.to_json(),
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "hardware_affinity": list(self.hardware_affinity),
            "workers": [w.to_json() for w in self.workers],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HyperNode:
        return cls(
            id=data["id"],
            kind=ComponentKind(data["kind"]),
            scaling=Scaling(data["scaling"]),
            depends_on=tuple(data["depends_on"]),
            interruptibility=Interruptibility(data["interruptibility"]),
            parallelism=Parallelism.from_json(data["parallelism"]),
            min_workers=int(data["min_workers"]),
            max_workers=None if data["max_workers"] is None else int(data["max_workers"]),
            hardware_affinity=tuple(data["hardware_affinity"]),
            workers=tuple(Worker.from_json(w) for w in data["workers"]),
        )


@dataclass(frozen=True)
class HyperEdge:
    """Data flow from one group to another within the current iteration."""

    id: str
    source: str
    target: str
    items_total: int = 0
    items_produced: int = 0
    items_consumed: int = 0
    affinity: Mapping[str, str] = field(default_factory=dict)  # episode id -> worker id (KV cache)

    @property
    def progress(self) -> float:
        return self.items_consumed / self.items_total if self.items_total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "source": self.source,
            "target": self.target,
            "items_total": self.items_total,
            "items_produced": self.items_produced,
            "items_consumed": self.items_consumed,
            "affinity": dict(sorted(self.affinity.items())),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HyperEdge:
        return cls(
            id=data["id"],
            source=data["source"],
            target=data["target"],
            items_total=int(data["items_total"]),
            items_produced=int(data["items_produced"]),
            items_consumed=int(data["items_consumed"]),
            affinity=dict(data["affinity"]),
        )


class SnapshotVersionError(ValueError):
    pass


@dataclass(frozen=True)
class Hypergraph:
    """The whole job at one instant."""

    job_id: str
    nodes: tuple[HyperNode, ...]
    edges: tuple[HyperEdge, ...] = ()
    iteration: int = 0
    policy_version: int = 0  # the trainer's weights version, for staleness accounting
    taken_at: float = 0.0  # seconds (wall clock or virtual time)

    def node(self, group_id: str) -> HyperNode:
        for n in self.nodes:
            if n.id == group_id:
                return n
        raise KeyError(group_id)

    def by_kind(self, kind: ComponentKind) -> tuple[HyperNode, ...]:
        return tuple(n for n in self.nodes if n.kind is kind)

    @property
    def gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def allocation(self) -> dict[str, tuple[str, ...]]:
        """group id -> device ids it holds."""
        return {n.id: n.device_ids for n in self.nodes}

    def with_node(self, node: HyperNode) -> Hypergraph:
        return replace(self, nodes=tuple(node if n.id == node.id else n for n in self.nodes))

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "job_id": self.job_id,
            "iteration": self.iteration,
            "policy_version": self.policy_version,
            "taken_at": self.taken_at,
            "nodes": [n.to_json() for n in self.nodes],
            "edges": [e.to_json() for e in self.edges],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Hypergraph:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SnapshotVersionError(f"unsupported snapshot schema_version {version!r}")
        return cls(
            job_id=data["job_id"],
            iteration=int(data["iteration"]),
            policy_version=int(data["policy_version"]),
            taken_at=float(data["taken_at"]),
            nodes=tuple(HyperNode.from_json(n) for n in data["nodes"]),
            edges=tuple(HyperEdge.from_json(e) for e in data["edges"]),
        )
