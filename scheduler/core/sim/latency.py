"""Decision latency at scale: a policy's ``decide`` on a synthetic 1,024-GPU, 64-group job.

The hypergraph mixes drained and busy rollout groups, log-prob groups with and without a
backlog, trainers and CPU-side groups, with signals of the shape the aggregator produces, so
every call walks the full candidate search (triggers, shrink candidates, predictions, costs).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from scheduler.core.costs import MigrationCostModel
from scheduler.core.hypergraph import ComponentKind, Device, Hypergraph, HyperNode, Parallelism, Worker
from scheduler.core.policies import build_policy
from scheduler.core.predictor import ThroughputPredictor
from scheduler.core.signals import GroupSignals
from scheduler.core.sim.results import percentile

GPUS_PER_NODE = 8
# (kind, groups, GPUs per group, GPUs per worker): 576 + 192 + 256 = 1,024 GPUs in 44 GPU groups,
# plus 20 CPU-side groups: 64 groups.
LAYOUT: tuple[tuple[ComponentKind, int, int, int], ...] = (
    (ComponentKind.ROLLOUT, 24, 24, 1),
    (ComponentKind.INFERENCE, 12, 16, 2),
    (ComponentKind.ACTOR, 8, 32, 2),
    (ComponentKind.REWARD, 10, 0, 0),
    (ComponentKind.TOOL, 10, 0, 0),
)
CPU_WORKERS = 8
MAX_RUNNING = 256


@dataclass(frozen=True)
class LatencyResult:
    policy: str
    gpus: int
    groups: int
    calls: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    decisions_per_call: float
    candidates_per_call: float


def synthetic_job(free_gpus: int = 16) -> tuple[Hypergraph, list[Device]]:
    """The 1,024-GPU, 64-group hypergraph (plus ``free_gpus`` free devices on extra nodes)."""
    devices = [
        Device(id=f"n{n:03d}-g{i}", node=f"n{n:03d}", hardware="H100", index=i)
        for n in range((1024 + free_gpus) // GPUS_PER_NODE)
        for i in range(GPUS_PER_NODE)
    ]
    cursor = 0
    nodes: list[HyperNode] = []
    for kind, count, gpus, per_worker in LAYOUT:
        for g in range(count):
            group_id = f"{kind.value}-{g}"
            if gpus:
                workers = tuple(
                    Worker(
                        f"{group_id}-w{w}",
                        tuple(devices[cursor + w * per_worker : cursor + (w + 1) * per_worker]),
                    )
                    for w in range(gpus // per_worker)
                )
                cursor += gpus
            else:
                workers = tuple(Worker(f"{group_id}-w{w}", ()) for w in range(CPU_WORKERS))
            valid_dp = tuple(2**k for k in range(8)) if kind is ComponentKind.ACTOR else ()
            nodes.append(
                HyperNode(
                    id=group_id,
                    kind=kind,
                    workers=workers,
                    parallelism=Parallelism(tp=max(per_worker, 1), valid_dp=valid_dp),
                    min_workers=1,
                )
            )
    return Hypergraph(job_id="latency-1024", nodes=tuple(nodes), iteration=3), devices[cursor:]


def synthetic_signals(graph: Hypergraph, rng: random.Random, now: float) -> dict[str, GroupSignals]:
    """Signals as the aggregator would fold them mid-iteration: about half the rollout groups in
    their tail (most workers under U_low), the rest busy with a backlog."""
    signals: dict[str, GroupSignals] = {}
    for node in graph.nodes:
        workers = len(node.workers)
        draining = node.is_dynamic and rng.random() < 0.5
        if draining:
            low = sorted(
                rng.sample([w.id for w in node.workers], k=max(1, int(workers * rng.uniform(0.6, 0.95))))
            )
            utilisation = rng.uniform(0.02, 0.15)
            queue, in_flight, progress = 0, rng.randint(1, 3 * workers), rng.uniform(0.8, 0.98)
        else:
            low = []
            utilisation = rng.uniform(0.6, 0.95)
            queue = rng.randint(0, 50) if node.kind is not ComponentKind.ACTOR else rng.randint(0, 3)
            in_flight, progress = workers * rng.randint(1, 50), rng.uniform(0.1, 0.7)
        signals[node.id] = GroupSignals(
            group_id=node.id,
            at=now,
            window_s=10.0,
            workers=workers,
            utilisation_mean=utilisation,
            utilisation_p50=utilisation,
            utilisation_p90=min(1.0, utilisation * 1.3),
            utilisation_p99=min(1.0, utilisation * 1.5),
            low_utilisation_fraction=len(low) / workers if workers else 0.0,
            low_utilisation_workers=tuple(low),
            queue_length=queue,
            in_flight=in_flight,
            max_in_flight_per_worker=MAX_RUNNING if node.kind is ComponentKind.ROLLOUT else 1,
            tokens_per_s=node.gpus * rng.uniform(500.0, 5000.0),
            progress=progress,
            busy=True,
        )
    return signals


def _profiles() -> dict[str, list[tuple[float, float]]]:
    return {
        ComponentKind.ROLLOUT.value: [(g, 9000.0 * g**0.85) for g in (1, 8, 32, 128)],
        ComponentKind.INFERENCE.value: [(g, 20000.0 * g) for g in (2, 8, 32, 128)],
        ComponentKind.ACTOR.value: [(g, 7000.0 * g) for g in (2, 8, 32, 128)],
    }


def decision_latency(policy: str = "dynarl", *, calls: int = 200, seed: int = 0) -> LatencyResult:
    """Wall time of ``calls`` decide() calls, each on fresh signals with a fresh policy (so no
    cooldown or pending move short-cuts the search)."""
    graph, free = synthetic_job()
    rng = random.Random(seed)
    timings: list[float] = []
    decisions = 0
    candidates = 0
    for call in range(calls):
        instance = build_policy(
            policy,
            predictor=ThroughputPredictor(_profiles()),
            cost_model=MigrationCostModel(model_params_b=7.6),
        )
        now = 100.0 + call
        signals = synthetic_signals(graph, rng, now)
        started = time.perf_counter()
        made = instance.decide(graph, signals, free, now)
        timings.append(time.perf_counter() - started)
        decisions += len(made)
        candidates += sum(len(d.candidates) for d in made)
    return LatencyResult(
        policy=policy,
        gpus=graph.gpus,
        groups=len(graph.nodes),
        calls=calls,
        p50_ms=1e3 * percentile(timings, 0.5),
        p99_ms=1e3 * percentile(timings, 0.99),
        max_ms=1e3 * max(timings),
        decisions_per_call=decisions / calls,
        candidates_per_call=candidates / calls,
    )
