"""Workload definitions: cluster, model, batch shape and the distributions the trace generator draws.

Every parameter is documented in docs/simulator.md with where it comes from. The named workloads
are the benchmark's; the ``*-tiny`` ones keep the tests fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from scheduler.core.sim.hardware import HARDWARE, MODELS, ModelSpec
from scheduler.core.sim.perf import PerfParams, divisors


class WorkloadKind(StrEnum):
    MATH = "math"  # single-turn reasoning: one response per episode
    AGENTIC = "agentic"  # multi-turn: response, tool call, tool output, next turn, ...


@dataclass(frozen=True)
class MathLengths:
    """Lognormal response lengths clipped at ``max_new_tokens``.

    ``log(length) = log(median) + sigma_prompt * z_prompt + sigma_sample * z_sample``: samples of one
    prompt share its difficulty ``z_prompt`` (hard problems make every sample long).
    """

    median_fraction: float = 0.133  # median response / max_new_tokens
    sigma_prompt: float = 0.55
    sigma_sample: float = 0.73
    min_tokens: int = 16


@dataclass(frozen=True)
class AgenticTurns:
    """Multi-turn episodes: tool calls per episode, per-turn lengths and tool latencies."""

    mean_tool_calls: float = 2.5  # geometric number of tool calls per episode
    max_turns: int = 10
    first_response_median: float = 1200.0
    response_decay: float = 0.6  # median of turn k is first_response_median * decay**k
    response_sigma: float = 0.8
    min_response_tokens: int = 8
    tool_output_median: float = 120.0
    tool_output_sigma: float = 1.0
    tool_output_max: int = 2048
    tool_latency_median_s: float = 2.0
    tool_latency_sigma: float = 1.0
    tool_latency_max_s: float = 60.0  # sandbox timeout
    context_limit: int = 16384  # an episode ends once its context would pass this


@dataclass(frozen=True)
class Workload:
    name: str
    kind: WorkloadKind
    model: str  # key of hardware.MODELS
    gpus: int
    prompts_per_iteration: int
    samples_per_prompt: int
    prompts_per_minibatch: int
    max_new_tokens: int  # per turn
    iterations: int = 10
    gpus_per_node: int = 8
    node_hardware: tuple[tuple[str, int], ...] = ()  # (hardware type, nodes); empty = all H100
    staleness: int | None = None  # None: synchronous; an int: async with staleness bound alpha
    log_prob_group: bool = True  # a separate inference group computes ref / old log-probs
    router_mode: str = "fifo"  # "fifo" or "priority": the rollout group's DataRouter
    max_running_requests: int = 256  # per engine (SGLang max_running_requests)
    prompt_median: float = 220.0
    prompt_sigma: float = 0.5
    prompt_min: int = 32
    prompt_max: int = 2048
    reward_latency_median_s: float = 0.05  # rule-based math verifier on CPU
    reward_latency_sigma: float = 1.0
    reward_workers: int = 8  # CPU reward workers
    reward_slots: int = 16  # concurrent verifications per reward worker
    tool_workers: int = 16  # CPU sandbox hosts (agentic)
    tool_slots: int = 32  # concurrent sandboxes per host
    math: MathLengths = field(default_factory=MathLengths)
    agentic: AgenticTurns = field(default_factory=AgenticTurns)
    perf: PerfParams = field(default_factory=PerfParams)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}")
        if self.gpus % self.gpus_per_node:
            raise ValueError("gpus must be a multiple of gpus_per_node")
        if self.prompts_per_iteration % self.prompts_per_minibatch:
            raise ValueError("prompts_per_iteration must be a multiple of prompts_per_minibatch")
        for hardware, _ in self.node_hardware:
            if hardware not in HARDWARE:
                raise ValueError(f"unknown hardware {hardware!r}")
        if self.node_hardware and sum(n for _, n in self.node_hardware) * self.gpus_per_node != self.gpus:
            raise ValueError("node_hardware must cover exactly gpus / gpus_per_node nodes")
        if self.router_mode not in ("fifo", "priority"):
            raise ValueError("router_mode must be 'fifo' or 'priority'")

    @property
    def model_spec(self) -> ModelSpec:
        return MODELS[self.model]

    @property
    def is_async(self) -> bool:
        return self.staleness is not None and self.staleness > 0

    @property
    def episodes_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt

    @property
    def minibatches_per_iteration(self) -> int:
        return self.prompts_per_iteration // self.prompts_per_minibatch

    @property
    def valid_trainer_dp(self) -> tuple[int, ...]:
        """Megatron needs the mini-batch's sequence count divisible by the data-parallel size."""
        return divisors(self.prompts_per_minibatch * self.samples_per_prompt)

    def hardware_of_nodes(self) -> list[str]:
        nodes = self.gpus // self.gpus_per_node
        if not self.node_hardware:
            return ["H100"] * nodes
        return [hardware for hardware, count in self.node_hardware for _ in range(count)]

    def with_overrides(self, **changes: object) -> Workload:
        return replace(self, **changes)  # type: ignore[arg-type]


def _math(name: str, model: str, gpus: int, **extra: object) -> Workload:
    # DAPO's recipe (public): 512 prompts x 16 samples per step, 32 prompts per mini-batch,
    # 16 384 expected response tokens.
    base = Workload(
        name=name,
        kind=WorkloadKind.MATH,
        model=model,
        gpus=gpus,
        prompts_per_iteration=512,
        samples_per_prompt=16,
        prompts_per_minibatch=32,
        max_new_tokens=16384,
    )
    return replace(base, **extra)  # type: ignore[arg-type]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        _math("math-1.5B-64", "1.5B", 64),
        _math("math-7B-64", "7B", 64),
        _math("math-32B-128", "32B", 128),
        _math("math-7B-64-async", "7B", 64, staleness=1),
        Workload(
            name="agentic-7B-64",
            kind=WorkloadKind.AGENTIC,
            model="7B",
            gpus=64,
            prompts_per_iteration=256,
            samples_per_prompt=16,
            prompts_per_minibatch=32,
            max_new_tokens=4096,
            router_mode="priority",
            max_running_requests=128,
            prompt_median=400.0,
            reward_latency_median_s=0.05,
        ),
        # Small versions for the tests: same models and code paths, a fraction of the work.
        Workload(
            name="math-tiny",
            kind=WorkloadKind.MATH,
            model="1.5B",
            gpus=16,
            prompts_per_iteration=16,
            samples_per_prompt=8,
            prompts_per_minibatch=4,
            max_new_tokens=4096,
            iterations=2,
            max_running_requests=32,
        ),
        Workload(
            name="math-tiny-async",
            kind=WorkloadKind.MATH,
            model="1.5B",
            gpus=16,
            prompts_per_iteration=16,
            samples_per_prompt=8,
            prompts_per_minibatch=4,
            max_new_tokens=4096,
            iterations=4,
            max_running_requests=32,
            staleness=1,
        ),
        Workload(
            name="agentic-tiny",
            kind=WorkloadKind.AGENTIC,
            model="1.5B",
            gpus=16,
            prompts_per_iteration=16,
            samples_per_prompt=4,
            prompts_per_minibatch=4,
            max_new_tokens=1024,
            iterations=2,
            router_mode="priority",
            max_running_requests=16,
            tool_workers=2,
            tool_slots=8,
            agentic=AgenticTurns(first_response_median=300.0, context_limit=4096),
        ),
    )
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        known = ", ".join(sorted(WORKLOADS))
        raise KeyError(f"unknown workload {name!r} (known: {known})") from None
