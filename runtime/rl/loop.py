"""The RL iteration: generate, reward, reference log-probs, train, push, verify.

`run_iteration` drives three small protocols, so the same loop runs in one process (tests, a
single-host job) and over Ray actors (a later change):

- `TrainerGroup`: every data-parallel rank takes the same global batch; rank 0 pushes the
  weights to every rollout engine and says which version it pushed;
- `RewardScorer`: the ``reward`` worker, exact match on the task's answer;
- `ReferenceScorer`: the frozen warm-start policy's log-probs of each response token, served by
  an ``inference`` engine (`EngineReference` asks any engine speaking SGLang's protocol).

The rollout engines are reached only through `EngineClient`, so they may be CPU engines or
SGLang servers. After the push every rollout engine must report the pushed weight version:
an engine that silently kept old weights would otherwise poison every later iteration.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol, TypeVar

from runtime.engine.client import EngineClient
from runtime.rl.agentic import AgenticStats, AgentLoop
from runtime.rl.grpo import Trajectory
from runtime.rl.job import RLJobConfig, iteration_problems
from runtime.rl.rollout import EnginePool, RolloutProgress, RolloutSample, rollout
from runtime.rl.trainer import Trainer, TrainStepMetrics
from runtime.rl.weight_push import WeightPusher
from runtime.task.arithmetic import Problem, score

T = TypeVar("T")


class WeightVersionMismatchError(RuntimeError):
    """After a push, a rollout engine does not report the version the trainer pushed."""

    def __init__(self, expected: str, reported: dict[str, str]) -> None:
        self.expected = expected
        self.reported = reported
        wrong = {url: version for url, version in reported.items() if version != expected}
        super().__init__(
            f"the trainer pushed weight version {expected!r} but {len(wrong)} of {len(reported)} "
            f"rollout engines report otherwise: {wrong}"
        )


# ---------------------------------------------------------------------------------- protocols


class TrainerGroup(Protocol):
    """The trainer's data-parallel ranks, driven as one."""

    def train(self, trajectories: Sequence[Trajectory], epochs: int) -> list[TrainStepMetrics]:
        """``epochs`` optimizer steps on the global batch (every rank gets all of it), one after
        the other with nothing between them: an iteration is trained whole or not at all."""
        ...

    def push_weights(self) -> str:
        """Rank 0 sends the current weights to every rollout engine; returns their version."""
        ...


class RewardScorer(Protocol):
    def score(self, problems_and_texts: Sequence[tuple[Problem, str]]) -> list[float]:
        """One reward per (problem, response text), in order."""
        ...


class ReferenceScorer(Protocol):
    def response_logprobs(
        self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[list[float]]:
        """The reference policy's log-prob of each response token, per (prompt ids, response ids)."""
        ...


# ---------------------------------------------------------------------------------- parts


class ExactMatchReward:
    """The task's rule-based reward, computed in-process."""

    def score(self, problems_and_texts: Sequence[tuple[Problem, str]]) -> list[float]:
        return [score(problem, text) for problem, text in problems_and_texts]


def _run_spread(
    pool: EnginePool,
    calls: Sequence[Callable[[EngineClient], T]],
    max_concurrency: int,
) -> list[T]:
    """Run every call on the pool's least loaded engine in service, concurrently; results in
    order. An engine a migration drains gets no new call; its calls under way finish."""

    def run(call: Callable[[EngineClient], T]) -> T:
        with pool.acquire() as (_, client):
            return call(client)

    if not calls:
        return []
    with ThreadPoolExecutor(
        max_workers=min(len(calls), max_concurrency), thread_name_prefix="reference"
    ) as executor:
        return list(executor.map(run, calls))


class EngineReference:
    """`ReferenceScorer` over ``inference`` engines holding the frozen warm-start weights:
    prefill-only ``/generate`` requests (`EngineClient.input_logprobs_batch`), ``batch_size``
    sequences per request, spread over the engines of a pool that a workload migration may
    change while it scores (``EnginePool``). Their rids are left to the server (SGLang gives each
    a UUID, never a prefix of another)."""

    def __init__(
        self,
        engines: Sequence[EngineClient] | EnginePool,
        batch_size: int = 16,
        max_concurrency: int = 16,
    ) -> None:
        if batch_size < 1 or max_concurrency < 1:
            raise ValueError("batch_size and max_concurrency must be positive")
        if not isinstance(engines, EnginePool) and not engines:
            raise ValueError("a reference needs at least one engine")
        self.pool = EnginePool.of(engines)
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency

    def response_logprobs(
        self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[list[float]]:
        # Up to ``batch_size`` sequences a request, and at least one request per engine in
        # service, so a small batch is still scored by all of them at once.
        engines = max(1, len(self.pool.active()))
        size = max(1, min(self.batch_size, math.ceil(len(sequences) / engines)))
        chunks = [list(sequences[i : i + size]) for i in range(0, len(sequences), size)]

        def scorer(
            chunk: list[tuple[Sequence[int], Sequence[int]]],
        ) -> Callable[[EngineClient], list[list[float]]]:
            def call(client: EngineClient) -> list[list[float]]:
                answers = client.input_logprobs_batch(
                    [[*prompt, *response] for prompt, response in chunk],
                    [len(prompt) for prompt, _ in chunk],
                )
                return [answer.logprobs for answer in answers]

            return call

        results = _run_spread(self.pool, [scorer(chunk) for chunk in chunks], self.max_concurrency)
        logprobs = [row for rows in results for row in rows]
        for (_, response), row in zip(sequences, logprobs, strict=True):
            if len(row) != len(response):
                raise RuntimeError(f"the reference scored {len(row)} of {len(response)} response tokens")
        return logprobs


class InProcessTrainerGroup:
    """A `TrainerGroup` of one rank in this process; rank 0's pusher feeds the rollout engines."""

    def __init__(self, trainer: Trainer, pusher: WeightPusher) -> None:
        if trainer.world_size != 1:
            raise ValueError("an in-process trainer group has exactly one rank")
        self.trainer = trainer
        self.pusher = pusher

    def train(self, trajectories: Sequence[Trajectory], epochs: int) -> list[TrainStepMetrics]:
        return [self.trainer.train_step(trajectories) for _ in range(epochs)]

    def push_weights(self) -> str:
        version = self.trainer.weight_version
        self.pusher.push(self.trainer.engine_weights(), version)
        return version


# ---------------------------------------------------------------------------------- report


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """The nearest-rank percentile (a value that occurred) of ascending values."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class LengthStats:
    """Response lengths in tokens; ``histogram`` holds (bucket upper bound, count) over
    power-of-two buckets (1], (1, 2], (2, 4], ..., empty buckets left out."""

    count: int
    mean: float
    min: int
    p50: int
    p90: int
    p99: int
    max: int
    histogram: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, lengths: Sequence[int]) -> LengthStats:
        ordered = sorted(lengths)
        if not ordered:
            raise ValueError("no lengths")
        buckets = Counter(1 << max(0, (length - 1).bit_length()) for length in ordered)
        return cls(
            count=len(ordered),
            mean=sum(ordered) / len(ordered),
            min=ordered[0],
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            max=ordered[-1],
            histogram=tuple(sorted(buckets.items())),
        )


@dataclass(frozen=True)
class PhaseSeconds:
    generate: float
    reward: float
    reference: float
    train: float
    push: float
    verify: float

    @property
    def total(self) -> float:
        return self.generate + self.reward + self.reference + self.train + self.push + self.verify


@dataclass(frozen=True)
class AgenticReport:
    """`AgenticStats` as a report carries them (the router's counters flattened)."""

    turns: int
    tool_calls: int
    tool_errors: int
    prompt_tokens: int
    cached_tokens: int
    reprefilled_tokens: int
    affinity_hits: int
    affinity_steals: int
    affinity_fallbacks: int
    router_mode: str

    @classmethod
    def of(cls, stats: AgenticStats) -> AgenticReport:
        return cls(
            turns=stats.turns,
            tool_calls=stats.tool_calls,
            tool_errors=stats.tool_errors,
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=stats.cached_tokens,
            reprefilled_tokens=stats.reprefilled_tokens,
            affinity_hits=stats.router.affinity_hits,
            affinity_steals=stats.router.affinity_steals,
            affinity_fallbacks=stats.router.affinity_fallbacks,
            router_mode=str(stats.router.mode_now),
        )


@dataclass(frozen=True)
class IterationReport:
    """What one iteration did, for the job's log and the control plane's predictor."""

    iteration: int
    trainer_step: int
    # The version every rollout engine reports after the push.
    weight_version: str
    # Versions the iteration's samples were generated under (one, unless weights moved mid-rollout).
    sampled_weight_versions: tuple[str, ...]
    prompts: int
    samples: int
    mean_reward: float
    # Share of samples with reward 1.
    accuracy: float
    # Share of groups whose rewards were all equal: they had zero advantage and taught nothing.
    uniform_groups: float
    response_length: LengthStats
    # Share of samples that stopped at max_new_tokens (or the context) rather than at EOS.
    truncated: float
    tokens_generated: int
    tokens_trained: int
    samples_per_engine: tuple[int, ...]
    seconds: PhaseSeconds
    loss: float
    policy_loss: float
    # Mean k3 KL to the reference per trained token; None when the job has no KL term (no
    # reference log-probs were asked for, so there is nothing to measure against).
    kl: float | None
    clip_fraction: float
    grad_norm: float
    stale_token_fraction: float
    # Samples a workload migration moved mid-generation (resumed on another engine after their
    # partial output).
    resumed_samples: int = 0
    # Turns, tool calls and KV reuse of an agentic rollout (None for single-turn tasks).
    agentic: AgenticReport | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> IterationReport:
        data: dict[str, Any] = json.loads(text)
        known = {f.name for f in fields(cls)}
        if set(data) != known:
            raise ValueError(f"an IterationReport has fields {sorted(known)}, got {sorted(data)}")
        lengths = data["response_length"]
        data["response_length"] = LengthStats(
            **{**lengths, "histogram": tuple((int(b), int(n)) for b, n in lengths["histogram"])}
        )
        data["seconds"] = PhaseSeconds(**data["seconds"])
        if data["agentic"] is not None:
            data["agentic"] = AgenticReport(**data["agentic"])
        data["sampled_weight_versions"] = tuple(data["sampled_weight_versions"])
        data["samples_per_engine"] = tuple(data["samples_per_engine"])
        return cls(**data)


# ---------------------------------------------------------------------------------- iteration


def engine_weight_versions(engines: Sequence[EngineClient]) -> dict[str, str]:
    """Each engine's reported weight version, by URL."""
    return {engine.base_url: engine.weight_version() for engine in engines}


def verify_weight_versions(engines: Sequence[EngineClient], expected: str) -> None:
    """Raise `WeightVersionMismatchError` unless every engine reports ``expected``."""
    reported = engine_weight_versions(engines)
    if any(version != expected for version in reported.values()):
        raise WeightVersionMismatchError(expected, reported)


def build_trajectories(
    samples: Sequence[RolloutSample],
    rewards: Sequence[float],
    reference: Sequence[Sequence[float]] | None,
    iteration: int,
) -> list[Trajectory]:
    if len(rewards) != len(samples):
        raise ValueError(f"{len(rewards)} rewards for {len(samples)} samples")
    if reference is not None and len(reference) != len(samples):
        raise ValueError(f"{len(reference)} reference rows for {len(samples)} samples")
    return [
        Trajectory(
            prompt_ids=sample.prompt_ids,
            response_ids=sample.response_ids,
            sampling_logprobs=sample.logprobs,
            weight_versions=sample.weight_versions,
            reward=float(reward),
            group_id=f"i{iteration}-{sample.group_id}",
            reference_logprobs=None if reference is None else tuple(reference[index]),
            trained=sample.trained,
        )
        for index, (sample, reward) in enumerate(zip(samples, rewards, strict=True))
    ]


def run_iteration(
    config: RLJobConfig,
    job_id: str,
    iteration: int,
    engines: Sequence[EngineClient] | EnginePool,
    reward: RewardScorer,
    reference: ReferenceScorer | None,
    trainer: TrainerGroup,
    progress: RolloutProgress | None = None,
    agent: AgentLoop | None = None,
) -> IterationReport:
    """One iteration of the job: generate ``group_size`` responses to each of the iteration's
    problems on the rollout ``engines`` (multi-turn episodes through ``agent`` for a calculator
    task), score them, ask the reference for its log-probs (only when the KL term is on), take
    ``ppo_epochs`` trainer steps on the global batch, push the new weights and check that every
    rollout engine reports them. The report's loss, KL, clip fraction and gradient norm are the
    means over those steps."""
    if reference is None and config.grpo.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs a reference scorer")
    if config.task.calculator != (agent is not None):
        raise ValueError("a calculator task needs an agent loop (its tool), and only it does")
    problems = iteration_problems(config, iteration)
    started = time.perf_counter()
    pool = EnginePool.of(engines)
    agentic: AgenticStats | None = None
    if agent is not None:
        samples, agentic = agent.rollout(pool, problems, config, job_id, iteration, progress=progress)
    else:
        samples = rollout(pool, problems, config, job_id, iteration, progress=progress)
    generated = time.perf_counter()
    rewards = reward.score([(problems[s.prompt_index], s.text) for s in samples])
    rewarded = time.perf_counter()
    reference_logprobs = None
    if config.grpo.kl_coef > 0 and reference is not None:
        reference_logprobs = reference.response_logprobs([(s.prompt_ids, s.response_ids) for s in samples])
    referenced = time.perf_counter()
    trajectories = build_trajectories(samples, rewards, reference_logprobs, iteration)
    steps = trainer.train(trajectories, config.ppo_epochs)
    metrics = steps[-1]
    trained = time.perf_counter()
    version = trainer.push_weights()
    pushed = time.perf_counter()
    if version != metrics.weight_version:
        raise WeightVersionMismatchError(metrics.weight_version, {"trainer push": version})
    verify_weight_versions(pool.clients(), version)
    verified = time.perf_counter()

    groups: dict[int, set[float]] = {}
    for sample, value in zip(samples, rewards, strict=True):
        groups.setdefault(sample.prompt_index, set()).add(value)
    engine_counts = Counter(sample.engine for sample in samples)
    return IterationReport(
        iteration=iteration,
        trainer_step=metrics.step,
        weight_version=version,
        sampled_weight_versions=tuple(
            sorted({str(v) for sample in samples for v in sample.weight_versions if v is not None})
        ),
        prompts=len(problems),
        samples=len(samples),
        mean_reward=sum(rewards) / len(rewards),
        accuracy=sum(1 for value in rewards if value == 1.0) / len(rewards),
        uniform_groups=sum(1 for values in groups.values() if len(values) == 1) / len(groups),
        response_length=LengthStats.of([len(sample.response_ids) for sample in samples]),
        truncated=sum(1 for sample in samples if sample.finish_type == "length") / len(samples),
        tokens_generated=sum(len(sample.response_ids) for sample in samples),
        tokens_trained=steps[0].grpo.response_tokens,
        samples_per_engine=tuple(engine_counts.get(index, 0) for index in range(len(pool.names))),
        seconds=PhaseSeconds(
            generate=generated - started,
            reward=rewarded - generated,
            reference=referenced - rewarded,
            train=trained - referenced,
            push=pushed - trained,
            verify=verified - pushed,
        ),
        loss=statistics.fmean(step.grpo.loss for step in steps),
        policy_loss=statistics.fmean(step.grpo.policy_loss for step in steps),
        kl=statistics.fmean(step.grpo.kl for step in steps) if reference_logprobs is not None else None,
        clip_fraction=statistics.fmean(step.grpo.clip_fraction for step in steps),
        grad_norm=statistics.fmean(step.grad_norm for step in steps),
        stale_token_fraction=steps[0].stale_token_fraction,
        resumed_samples=sum(1 for sample in samples if sample.attempts > 1),
        agentic=None if agentic is None else AgenticReport.of(agentic),
    )
