"""A control plane in miniature for backend tests without Django: it launches workers on
SimBackends, keeps each node's latest progress report, and answers with the heartbeat reply's
``jobs`` section as ``agents.services.progress.reply_for`` builds it (frozen partitions per
iteration, claims, sums of completed samples, the job's iteration advanced once every actor node
trained)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agents.backends.sim.backend import ManualClock, SimBackend


def math_spec(
    *,
    rollout: int = 2,
    actor: int = 1,
    prompts: int = 8,
    samples: int = 4,
    max_new_tokens: int = 512,
    iterations: int = 2,
    staleness: int = 0,
    kind: str = "math",
    inference: int = 0,
    reward: int = 0,
) -> dict[str, Any]:
    components: list[dict[str, Any]] = [
        {
            "name": "rollout",
            "kind": "rollout",
            "tp": 1,
            "pp": 1,
            "valid_dp": [],
            "workers": rollout,
            "depends_on": [],
        },
    ]
    actor_deps = ["rollout"]
    if inference:
        components.append(
            {
                "name": "inference",
                "kind": "inference",
                "tp": 1,
                "pp": 1,
                "valid_dp": [],
                "workers": inference,
                "depends_on": ["rollout"],
            }
        )
        actor_deps.append("inference")
    if reward:
        components.append(
            {
                "name": "reward",
                "kind": "reward",
                "tp": 1,
                "pp": 1,
                "valid_dp": [],
                "workers": reward,
                "depends_on": ["rollout"],
            }
        )
        actor_deps.append("reward")
    components.append(
        {
            "name": "actor",
            "kind": "actor",
            "tp": 1,
            "pp": 1,
            "valid_dp": [],
            "workers": actor,
            "depends_on": actor_deps,
        }
    )
    return {
        "spec_version": 1,
        "name": "sim-test",
        "model": {"name": "qwen2.5-1.5b", "params_b": 1.5},
        "workload": {
            "kind": kind,
            "iterations": iterations,
            "prompts_per_iteration": prompts,
            "samples_per_prompt": samples,
            "max_new_tokens": max_new_tokens,
            "staleness": staleness,
            "trace": None,
            "max_turns": 4 if kind == "agentic" else None,
            "tool_latency_s": 1.0 if kind == "agentic" else None,
        },
        "components": components,
        "policy": {"name": "dynarl", "params": {}},
    }


@dataclass
class Relay:
    job_id: int
    spec: dict[str, Any]
    backends: dict[str, SimBackend]
    placement: dict[str, tuple[str, str, list[int]]] = field(
        default_factory=dict
    )  # worker -> (node, group, devices)
    iteration: int = 0
    leaving: set[str] = field(default_factory=set)
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    partitions: dict[int, dict[str, list[str]]] = field(default_factory=dict)
    claims: dict[tuple[int, str], set[str]] = field(default_factory=dict)
    advanced: list[int] = field(default_factory=list)

    @property
    def total(self) -> int:
        w = self.spec["workload"]
        return int(w["prompts_per_iteration"]) * int(w["samples_per_prompt"])

    @property
    def iterations(self) -> int:
        return int(self.spec["workload"]["iterations"])

    def kind(self, group: str) -> str:
        return next(c["kind"] for c in self.spec["components"] if c["name"] == group)

    def launch(
        self, worker: str, node: str, group: str, devices: list[int], *, shared: bool = False
    ) -> dict[str, Any]:
        """``shared``: the devices are time-shared with other workers of the job (colocated)."""
        return self.launch_together(node, [(worker, group, devices)], shared=shared)

    def launch_together(
        self, node: str, workers: list[tuple[str, str, list[int]]], *, shared: bool = False
    ) -> dict[str, Any]:
        """One launch command for several ``(worker, group, devices)`` of one node."""
        entries = []
        for worker, group, devices in workers:
            self.placement[worker] = (node, group, devices)
            entries.append(
                {
                    "worker": worker,
                    "job": self.job_id,
                    "group": group,
                    "kind": self.kind(group),
                    "tp": 1,
                    "pp": 1,
                    "devices": [
                        {"uid": f"{node}/gpu{i}", "index": i, "hardware": "H100", "shared": shared}
                        for i in devices
                    ],
                }
            )
        return self.backends[node].launch_workers({"job": self.job_id, "spec": self.spec}, entries)

    def live(self, group: str) -> list[str]:
        return sorted(w for w, (_, g, _) in self.placement.items() if g == group)

    def record(self, node: str, jobs: list[dict[str, Any]]) -> None:
        for entry in jobs:
            if entry["job"] != self.job_id:
                continue
            self.entries[node] = entry
            for b, by_group in entry.get("claims", {}).items():
                for g, names in by_group.items():
                    self.claims.setdefault((int(b), g), set()).update(names)
        actor_nodes = {n for w, (n, g, _) in self.placement.items() if self.kind(g) == "actor"}
        trained = [self.entries.get(n, {}).get("trained_iteration") for n in actor_nodes]
        if actor_nodes and all(t is not None for t in trained):
            target = min(min(t for t in trained if t is not None) + 1, self.iterations)
            if target > self.iteration:
                self.iteration = target
                self.advanced.append(target)

    def reply(self, node: str) -> dict[str, Any]:
        groups: dict[str, Any] = {}
        for c in self.spec["components"]:
            g = c["name"]
            live = self.live(g)
            workers = [w for w in live if w not in self.leaving] or live
            reports = [
                e["groups"][g]["completed"]
                for e in self.entries.values()
                if e["iteration"] == self.iteration and g in e["groups"]
            ]
            completed = max(reports, default=0) if c["kind"] == "actor" else sum(reports)
            groups[g] = {"kind": c["kind"], "workers": workers, "completed": completed, "total": self.total}
        partitions: dict[str, Any] = {}
        staleness = int(self.spec["workload"]["staleness"])
        for b in range(self.iteration, min(self.iteration + staleness, self.iterations - 1) + 1):
            if b not in self.partitions:
                current = {g: groups[g]["workers"] for g in groups if groups[g]["kind"] == "rollout"}
                if not all(current.values()):
                    break  # nothing to partition over yet
                self.partitions[b] = current
            frozen = self.partitions[b]
            partitions[str(b)] = {}
            for g, members in frozen.items():
                claimed = self.claims.get((b, g), set())
                current = groups[g]["workers"]
                adopt = {
                    m: current[i % len(current)]
                    for i, m in enumerate(members)
                    if m not in claimed and (m not in self.live(g) or m in self.leaving) and current
                }
                partitions[str(b)][g] = {"workers": members, "claimed": sorted(claimed), "adopt": adopt}
        return {
            "jobs": {
                str(self.job_id): {
                    "iteration": self.iteration,
                    "state": "running",
                    "iterations_total": self.iterations,
                    "groups": groups,
                    "partitions": partitions,
                }
            }
        }

    def exchange(self) -> None:
        """One heartbeat round: every node reports, then every node reads its reply."""
        for node, backend in self.backends.items():
            self.record(node, backend.telemetry().jobs)
        for node, backend in self.backends.items():
            backend.observe_control(self.reply(node))


def manual_backends(*hosts: str, clock: ManualClock, **kwargs: Any) -> dict[str, SimBackend]:
    options: dict[str, Any] = {"gpus": 8, "speed": 10.0, "faults": [], "sample_interval_s": 0.5}
    options.update(kwargs)
    return {h: SimBackend(h, clock=clock, **options) for h in hosts}


def run_until(relay: Relay, clock: ManualClock, done: Any, *, step_s: float = 0.2, limit: int = 5000) -> int:
    for round_ in range(limit):
        relay.exchange()
        if done():
            return round_
        clock.advance(step_s)
    raise AssertionError("the condition was not reached")


def reply_jobs(reply: Mapping[str, Any]) -> Mapping[str, Any]:
    return reply["jobs"]
