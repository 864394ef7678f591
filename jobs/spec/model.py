"""The parsed spec: frozen dataclasses both formats produce (``JobSpec`` and its parts), their
stored JSON form, and the constants of what a spec may say."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from jobs.spec.errors import FieldError, SpecError
from scheduler.core.hypergraph import ComponentKind, Parallelism

SPEC_VERSION: Final = 1

JOB_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9._-]{1,100}")
COMPONENT_NAME_PATTERN: Final = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
BACKENDS: Final = ("sim", "ray")
WORKLOAD_KINDS: Final = ("math", "agentic")
SOURCE_FORMATS: Final = ("dynarl", "rlinf")
COLOCATED_POLICY: Final = "static-colocated"
DEFAULT_POLICY: Final = "dynarl"

# A job's priority is stored in a 32-bit database column.
PRIORITY_MIN: Final = -(2**31)
PRIORITY_MAX: Final = 2**31 - 1
MAX_TICK_SECONDS: Final = 3600.0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params_b: float  # billions of parameters; sizes the trainer state a p2p migration moves

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "params_b": self.params_b}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelSpec:
        return cls(name=data["name"], params_b=float(data["params_b"]))


@dataclass(frozen=True)
class WorkloadSpec:
    """The data and batch shape of one RL iteration."""

    kind: str = "math"  # one of WORKLOAD_KINDS
    iterations: int = 10
    prompts_per_iteration: int = 512
    samples_per_prompt: int = 8
    max_new_tokens: int = 8192
    staleness: int = 0  # async bound: rollouts may lag the trainer by this many versions (0 = synchronous)
    trace: str | None = None  # JSONL trace of rollout lengths / turns (docs/trace-format.md)
    max_turns: int | None = None  # agentic only
    tool_latency_s: float | None = None  # agentic only

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "iterations": self.iterations,
            "prompts_per_iteration": self.prompts_per_iteration,
            "samples_per_prompt": self.samples_per_prompt,
            "max_new_tokens": self.max_new_tokens,
            "staleness": self.staleness,
            "trace": self.trace,
            "max_turns": self.max_turns,
            "tool_latency_s": self.tool_latency_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkloadSpec:
        return cls(
            kind=data["kind"],
            iterations=int(data["iterations"]),
            prompts_per_iteration=int(data["prompts_per_iteration"]),
            samples_per_prompt=int(data["samples_per_prompt"]),
            max_new_tokens=int(data["max_new_tokens"]),
            staleness=int(data["staleness"]),
            trace=data["trace"],
            max_turns=None if data["max_turns"] is None else int(data["max_turns"]),
            tool_latency_s=None if data["tool_latency_s"] is None else float(data["tool_latency_s"]),
        )


@dataclass(frozen=True)
class RuntimeModelSpec:
    """The policy network of a job on the ``ray`` backend: a small GPT (megatron-core GPTModel)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int = 128
    max_positions: int = 64

    def to_json(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "ffn_hidden_size": self.ffn_hidden_size,
            "max_positions": self.max_positions,
        }


@dataclass(frozen=True)
class RuntimeSpec:
    """What a job on the ``ray`` backend really runs (``runtime`` in the spec): the model, the
    arithmetic task's size distribution and the training settings. The batch shape and the number
    of iterations are the workload's."""

    model: RuntimeModelSpec = field(default_factory=RuntimeModelSpec)
    max_digits: int = 2  # problem sizes: P(n digits) ~ n ** -zipf_exponent on 1..max_digits
    zipf_exponent: float = 1.2
    dataset_size: int | None = None  # distinct problems the job trains over; None: fresh ones every iteration
    seed: int = 0
    temperature: float = 1.0
    learning_rate: float = 5e-4
    kl_coef: float = 0.0
    micro_batch_size: int = 64
    # Optimizer steps on each iteration's batch (PPO's epochs): the trainer's work per iteration.
    ppo_epochs: int = 1
    warm_start_steps: int = 300
    # Rollout and inference engines: real SGLang where it is installed and CUDA is present, else
    # the CPU stand-in ("auto"); "sglang" fails a worker that cannot run it; "cpu" always the stand-in.
    engine: str = "auto"
    # An agentic job's dispatch of turns to engines: "priority" (the DataRouter's order and KV
    # affinity) or "fifo".
    routing: str = "priority"

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "routing": self.routing,
            "model": self.model.to_json(),
            "task": {"max_digits": self.max_digits, "zipf_exponent": self.zipf_exponent},
            "dataset_size": self.dataset_size,
            "seed": self.seed,
            "temperature": self.temperature,
            "learning_rate": self.learning_rate,
            "kl_coef": self.kl_coef,
            "micro_batch_size": self.micro_batch_size,
            "ppo_epochs": self.ppo_epochs,
            "warm_start_steps": self.warm_start_steps,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RuntimeSpec:
        return cls(
            model=RuntimeModelSpec(**{k: int(v) for k, v in data["model"].items()}),
            max_digits=int(data["task"]["max_digits"]),
            zipf_exponent=float(data["task"]["zipf_exponent"]),
            dataset_size=None if data.get("dataset_size") is None else int(data["dataset_size"]),
            seed=int(data["seed"]),
            temperature=float(data["temperature"]),
            learning_rate=float(data["learning_rate"]),
            kl_coef=float(data["kl_coef"]),
            micro_batch_size=int(data["micro_batch_size"]),
            ppo_epochs=int(data.get("ppo_epochs", 1)),
            warm_start_steps=int(data["warm_start_steps"]),
            engine=str(data.get("engine", "auto")),
            routing=str(data.get("routing", "priority")),
        )


@dataclass(frozen=True)
class ComponentSpec:
    """One component (one WorkerGroup) at job start.

    Exactly one of ``workers`` (a count; admission picks the devices) and ``placement`` (explicit
    global GPU ranks, expanded and sorted) is set.
    """

    name: str
    kind: ComponentKind
    tp: int = 1
    pp: int = 1
    valid_dp: tuple[int, ...] = ()  # sorted; empty = any count between min and max
    workers: int | None = None
    placement: tuple[int, ...] | None = None
    min_workers: int = 1
    max_workers: int | None = None
    hardware: tuple[str, ...] = ()  # hardware types, best first; empty = any
    depends_on: tuple[str, ...] = ()
    colocated_with: tuple[str, ...] = ()  # components this one may share placement GPUs with

    @property
    def gpus_per_worker(self) -> int:
        return self.tp * self.pp

    @property
    def worker_count(self) -> int:
        if self.workers is not None:
            return self.workers
        assert self.placement is not None
        return len(self.placement) // self.gpus_per_worker

    @property
    def gpus(self) -> int:
        return self.worker_count * self.gpus_per_worker

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(tp=self.tp, pp=self.pp, valid_dp=self.valid_dp)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "tp": self.tp,
            "pp": self.pp,
            "valid_dp": list(self.valid_dp),
            "workers": self.workers,
            "placement": None if self.placement is None else list(self.placement),
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "hardware": list(self.hardware),
            "depends_on": list(self.depends_on),
            "colocated_with": list(self.colocated_with),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ComponentSpec:
        return cls(
            name=data["name"],
            kind=ComponentKind(data["kind"]),
            tp=int(data["tp"]),
            pp=int(data["pp"]),
            valid_dp=tuple(int(x) for x in data["valid_dp"]),
            workers=None if data["workers"] is None else int(data["workers"]),
            placement=None if data["placement"] is None else tuple(int(r) for r in data["placement"]),
            min_workers=int(data["min_workers"]),
            max_workers=None if data["max_workers"] is None else int(data["max_workers"]),
            hardware=tuple(data["hardware"]),
            depends_on=tuple(data["depends_on"]),
            colocated_with=tuple(data["colocated_with"]),
        )


@dataclass(frozen=True)
class PolicySpec:
    name: str = DEFAULT_POLICY
    params: Mapping[str, Any] = field(default_factory=dict)  # as given; the policy fills in defaults

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PolicySpec:
        return cls(name=data["name"], params=dict(data["params"]))


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: ModelSpec
    components: tuple[ComponentSpec, ...]
    priority: int = 0
    backend: str = "sim"
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    policy: PolicySpec = field(default_factory=PolicySpec)
    tick_seconds: float = 1.0
    source_format: str = "dynarl"  # one of SOURCE_FORMATS
    runtime: RuntimeSpec | None = None  # only on the ray backend, which runs the job for real

    @property
    def total_gpus(self) -> int:
        """GPUs the job holds at start; GPUs shared by colocated components count once."""
        placed: set[int] = set()
        counted = 0
        for component in self.components:
            if component.placement is not None:
                placed.update(component.placement)
            else:
                counted += component.gpus
        return len(placed) + counted

    def component(self, name: str) -> ComponentSpec:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(name)

    def components_of(self, kind: ComponentKind) -> tuple[ComponentSpec, ...]:
        return tuple(c for c in self.components if c.kind is kind)

    def to_json(self) -> dict[str, Any]:
        return {
            "spec_version": SPEC_VERSION,
            "source_format": self.source_format,
            "name": self.name,
            "priority": self.priority,
            "backend": self.backend,
            "model": self.model.to_json(),
            "workload": self.workload.to_json(),
            "components": [c.to_json() for c in self.components],
            "policy": self.policy.to_json(),
            "tick_seconds": self.tick_seconds,
            **({"runtime": self.runtime.to_json()} if self.runtime is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        """Load what ``to_json`` stored; a document of another spec version is refused."""
        version = data.get("spec_version")
        if version != SPEC_VERSION:
            raise SpecError([FieldError("spec_version", f"unsupported stored spec version {version!r}")])
        return cls(
            name=data["name"],
            priority=int(data["priority"]),
            backend=data["backend"],
            model=ModelSpec.from_json(data["model"]),
            workload=WorkloadSpec.from_json(data["workload"]),
            components=tuple(ComponentSpec.from_json(c) for c in data["components"]),
            policy=PolicySpec.from_json(data["policy"]),
            tick_seconds=float(data["tick_seconds"]),
            source_format=data["source_format"],
            runtime=RuntimeSpec.from_json(data["runtime"]) if data.get("runtime") is not None else None,
        )
