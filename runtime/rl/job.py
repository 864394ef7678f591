"""What one RL job is: its configuration, its problems and its request ids.

`RLJobConfig` is everything a job needs to run (model shape, task, batch shape, sampling,
trainer and warm-start settings), frozen, validated and JSON round-trippable, so the control
plane can hand it to every worker as text. The rest are pure functions of it: the problems of an
iteration (fresh each time, or walked epoch by epoch through the job's dataset) and the rid and
sampling seed of each sample. The warm start's weights are `runtime.rl.warm_start`'s: this module
stays free of the training stack (megatron-core), so a node agent reads a job's configuration
without importing it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from runtime.engine.client import make_rid
from runtime.engine.cpu_engine import EngineSettings
from runtime.model.config import GPTConfig
from runtime.model.sft_config import SFTConfig
from runtime.rl.grpo import GRPOConfig
from runtime.rl.trainer_config import TrainerConfig
from runtime.task.arithmetic import TOOL_CALL_END, Problem, TaskConfig, generate_problems, iter_problems
from runtime.task.tokenizer import EOS_ID, PAD_ID, CharTokenizer

# The weight version the warm-start weights carry: the trainer's version before its first step.
INITIAL_WEIGHT_VERSION = "0"


# How an agentic job's turns reach the engines (runtime.rl.agentic.Routing's values).
ROUTINGS = ("priority", "fifo")


def _derived_seed(*parts: object) -> int:
    """A 31-bit seed from the parts, stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256("/".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF


def _check_type(owner: str, name: str, value: object, kind: type) -> None:
    # JSON hands over whatever the author wrote; a string where a number belongs must be named
    # here rather than fail later as a TypeError deep inside a comparison.
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise ValueError(f"{owner}.{name} must be {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class RLJobConfig:
    """One RL post-training job. The global batch is ``prompts_per_iteration * group_size``.

    Sampling log-probs are those of the temperature-scaled distribution (what SGLang returns)
    while the trainer scores tokens at temperature 1, so at any ``temperature`` other than 1 the
    PPO ratio starts away from 1: the clipping then treats the rollout as off-policy.
    """

    model: GPTConfig
    task: TaskConfig = field(default_factory=TaskConfig)
    seed: int = 0
    iterations: int = 100
    prompts_per_iteration: int = 16
    group_size: int = 8
    # None: fresh problems every iteration. N: a dataset of N distinct problems drawn once from
    # the seed, which the iterations go through epoch after epoch (as a job over a fixed prompt
    # set does).
    dataset_size: int | None = None
    max_new_tokens: int = 192
    temperature: float = 1.0
    # Trainer (TrainerConfig's fields; the global batch size follows from the two above).
    learning_rate: float = 1e-4
    micro_batch_size: int = 16
    # Optimizer steps on each iteration's batch (PPO's epochs; verl's ``ppo_epochs``): after the
    # first, the policy has moved off the one that sampled the batch, and the clipped ratio
    # bounds how far each further step takes it.
    ppo_epochs: int = 1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # Supervised warm start (SFTConfig's fields; its seed and task are the job's).
    warm_start_steps: int = 500
    warm_start_batch_size: int = 16
    warm_start_learning_rate: float = 5e-3
    warm_start_warmup_steps: int = 20
    # The agentic variant (task.calculator): the calculator's latency per call, and how its
    # turns are dispatched to the engines ("priority": the DataRouter's order and KV affinity;
    # "fifo": arrival order, any engine).
    tool_latency_s: float = 0.0
    routing: str = "priority"

    _INT_FIELDS: ClassVar[tuple[str, ...]] = (
        "seed",
        "iterations",
        "prompts_per_iteration",
        "group_size",
        "max_new_tokens",
        "micro_batch_size",
        "ppo_epochs",
        "warm_start_steps",
        "warm_start_batch_size",
        "warm_start_warmup_steps",
    )
    _FLOAT_FIELDS: ClassVar[tuple[str, ...]] = (
        "temperature",
        "learning_rate",
        "weight_decay",
        "max_grad_norm",
        "warm_start_learning_rate",
        "tool_latency_s",
    )
    _NESTED: ClassVar[dict[str, type]] = {"model": GPTConfig, "task": TaskConfig, "grpo": GRPOConfig}

    def __post_init__(self) -> None:
        for name, kind in self._NESTED.items():
            _check_type("RLJobConfig", name, getattr(self, name), kind)
        for name in self._INT_FIELDS:
            _check_type("RLJobConfig", name, getattr(self, name), int)
        if self.dataset_size is not None:
            _check_type("RLJobConfig", "dataset_size", self.dataset_size, int)
            if self.dataset_size < 1:
                raise ValueError(f"RLJobConfig.dataset_size must be at least 1, got {self.dataset_size}")
        for name in self._FLOAT_FIELDS:
            _check_type("RLJobConfig", name, getattr(self, name), float)
        minimums = {
            "seed": 0,
            "iterations": 1,
            "prompts_per_iteration": 1,
            # A group of one always has advantage zero: nothing would be learned.
            "group_size": 2,
            "max_new_tokens": 1,
            "micro_batch_size": 1,
            "ppo_epochs": 1,
            "warm_start_steps": 0,
            "warm_start_batch_size": 1,
            "warm_start_warmup_steps": 0,
        }
        for name, least in minimums.items():
            if getattr(self, name) < least:
                raise ValueError(f"RLJobConfig.{name} must be at least {least}, got {getattr(self, name)}")
        # Greedy sampling makes every response of a group the same: zero advantages.
        for name in ("temperature", "learning_rate", "max_grad_norm", "warm_start_learning_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RLJobConfig.{name} must be positive, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"RLJobConfig.weight_decay must be non-negative, got {self.weight_decay}")
        if self.tool_latency_s < 0:
            raise ValueError(f"RLJobConfig.tool_latency_s must be non-negative, got {self.tool_latency_s}")
        if self.routing not in ROUTINGS:
            raise ValueError(
                f"RLJobConfig.routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}"
            )
        vocab = CharTokenizer().vocab_size
        if self.model.vocab_size != vocab:
            raise ValueError(
                f"RLJobConfig.model.vocab_size must be the task tokenizer's {vocab}, got {self.model.vocab_size}"
            )
        # BOS, the operands, the "+"s and the newline; every prompt + response must fit the
        # context of the engine and of the trainer's position embeddings.
        longest_prompt = 1 + self.task.longest_prompt_chars()
        if longest_prompt + self.max_new_tokens > self.model.max_positions:
            raise ValueError(
                f"RLJobConfig.max_new_tokens: the longest prompt ({longest_prompt} tokens) plus "
                f"{self.max_new_tokens} new tokens exceeds model.max_positions={self.model.max_positions}"
            )

    @property
    def global_batch_size(self) -> int:
        return self.prompts_per_iteration * self.group_size

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(
            model=self.model,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            learning_rate=self.learning_rate,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
            seed=self.seed,
            pad_id=PAD_ID,
            grpo=self.grpo,
        )

    def sft_config(self) -> SFTConfig:
        return SFTConfig(
            steps=self.warm_start_steps,
            batch_size=self.warm_start_batch_size,
            learning_rate=self.warm_start_learning_rate,
            warmup_steps=self.warm_start_warmup_steps,
            seed=self.seed,
            task=self.task,
        )

    def engine_settings(
        self, max_running_requests: int = 64, weight_version: str = INITIAL_WEIGHT_VERSION
    ) -> EngineSettings:
        """Settings for a CPU engine of this job (rollout or reference): the task's EOS, the
        job's seed, and the version the trainer's weights have before its first step."""
        return EngineSettings(
            max_running_requests=max_running_requests,
            eos_token_id=EOS_ID,
            seed=self.seed,
            weight_version=weight_version,
        )

    def sampling_params(self, seed: int) -> dict[str, Any]:
        """SGLang ``sampling_params`` of one rollout sample. EOS is named as a stop token, so a
        server that does not know this tokenizer's EOS stops there too; with the calculator, a
        turn also stops where the model ends a tool call."""
        stops = [EOS_ID]
        if self.task.calculator:
            stops.append(CharTokenizer().encode(TOOL_CALL_END)[0])
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "stop_token_ids": stops,
            "sampling_seed": seed,
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RLJobConfig:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("an RLJobConfig must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown RLJobConfig fields: {unknown}")
        if "model" not in data:
            raise ValueError("RLJobConfig.model is required")
        values: dict[str, Any] = dict(data)
        for name, kind in cls._NESTED.items():
            if name not in values:
                continue
            nested = values[name]
            if not isinstance(nested, dict):
                raise ValueError(f"RLJobConfig.{name} must be an object, got {nested!r}")
            names = {f.name for f in fields(kind)}
            extra = sorted(set(nested) - names)
            if extra:
                raise ValueError(f"unknown RLJobConfig.{name} fields: {extra}")
            try:
                values[name] = kind(**nested)
            except (TypeError, ValueError) as error:
                raise ValueError(f"RLJobConfig.{name}: {error}") from error
        return cls(**values)


def job_dataset(config: RLJobConfig) -> list[Problem]:
    """The job's ``dataset_size`` distinct problems, drawn once from the job's seed (empty when
    the job draws fresh problems every iteration)."""
    if config.dataset_size is None:
        return []
    stream = iter_problems(_derived_seed("dynarl-dataset", config.seed), config.task)
    chosen: dict[str, Problem] = {}
    # A task with few distinct problems (one digit: 100) may not have dataset_size of them.
    for problem in itertools.islice(stream, 1000 * config.dataset_size):
        chosen.setdefault(problem.prompt_text, problem)
        if len(chosen) == config.dataset_size:
            return list(chosen.values())
    raise ValueError(
        f"RLJobConfig.dataset_size: the task gave only {len(chosen)} distinct problems, "
        f"not {config.dataset_size}"
    )


def iteration_problems(config: RLJobConfig, iteration: int) -> list[Problem]:
    """The ``prompts_per_iteration`` problems of one iteration: a function of (seed, iteration)
    alone, so a resumed or re-run iteration sees the same problems.

    Without a dataset every iteration draws fresh problems. With one, the iterations walk
    through seeded shuffles of it, one epoch after another (a problem may repeat within an
    iteration only where one epoch ends and the next begins).
    """
    if iteration < 0:
        raise ValueError(f"iteration must be non-negative, got {iteration}")
    count = config.prompts_per_iteration
    if config.dataset_size is None:
        return generate_problems(count, _derived_seed("dynarl-problems", config.seed, iteration), config.task)
    dataset = job_dataset(config)
    orders: dict[int, list[int]] = {}
    problems: list[Problem] = []
    for position in range(iteration * count, (iteration + 1) * count):
        epoch, index = divmod(position, len(dataset))
        if epoch not in orders:
            orders[epoch] = list(range(len(dataset)))
            random.Random(_derived_seed("dynarl-epoch", config.seed, epoch)).shuffle(orders[epoch])
        problems.append(dataset[orders[epoch][index]])
    return problems


def sample_rid(job_id: str, iteration: int, prompt: int, sample: int, attempt: int = 0) -> str:
    """The rid of one sample: unique within a job and never a prefix of another (see make_rid)."""
    return make_rid(job_id, iteration, sample, attempt, prompt=prompt)


def sample_seed(config: RLJobConfig, iteration: int, prompt: int, sample: int, turn: int = 0) -> int:
    """The sampling seed of one sample (of one turn of an agentic episode), so a rollout does
    not depend on which engine served it or in which order."""
    if turn:
        return _derived_seed("dynarl-sampling", config.seed, iteration, prompt, sample, turn)
    return _derived_seed("dynarl-sampling", config.seed, iteration, prompt, sample)
