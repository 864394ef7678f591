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
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, TypeVar

from runtime.engine.client import EngineClient, GenerateResult
from runtime.rl.grpo import Trajectory
from runtime.rl.job import RLJobConfig, iteration_problems, sample_rid, sample_seed
from runtime.rl.trainer import Trainer, TrainStepMetrics
from runtime.rl.weight_push import WeightPusher
from runtime.task.arithmetic import Problem, score
from runtime.task.tokenizer import CharTokenizer

T = TypeVar("T")
TOKENIZER = CharTokenizer()
# Groups in flight at once from one rollout call: enough to fill every engine's running batch,
# few enough that the client's threads stay cheap.
DEFAULT_MAX_CONCURRENCY = 64


class RolloutError(RuntimeError):
    """The rollout did not produce a usable sample (an aborted or empty response)."""


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

    def train_step(self, trajectories: Sequence[Trajectory]) -> TrainStepMetrics:
        """One optimizer step on the global batch (every rank gets all of it)."""
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

    def train_step(self, trajectories: Sequence[Trajectory]) -> TrainStepMetrics:
        return self.trainer.train_step(trajectories)

    def push_weights(self) -> str:
        version = self.trainer.weight_version
        self.pusher.push(self.trainer.engine_weights(), version)
        return version


# ---------------------------------------------------------------------------------- rollout


@dataclass(frozen=True)
class RolloutSample:
    """One generated response, as the engine returned it."""

    prompt_index: int
    sample_index: int
    rid: str
    engine: int  # index into the rollout engines
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_versions: tuple[str | None, ...]
    finish_type: str
    text: str
    # How many requests it took: more than one when a workload migration moved it mid-generation.
    attempts: int = 1

    @property
    def group_id(self) -> str:
        return f"p{self.prompt_index}"


# Called as the rollout goes: per engine, (samples finished, samples finished or in flight).
RolloutProgress = Callable[[dict[str, tuple[int, int]]], None]


class EnginePool:
    """The rollout engines a rollout spreads over, by name, and what it has in flight on each.

    A workload migration changes the pool while requests run (runtime/rl/migration notes in
    docs/ray-backend.md): ``drain`` stops routing to engines (their requests in flight finish, or
    come back aborted with their partial output and are resumed elsewhere), ``add`` brings new
    engines in, ``remove`` forgets drained ones. ``names`` lists every engine the pool ever had,
    in order, so a sample's ``engine`` index stays meaningful across changes."""

    def __init__(
        self, clients: Mapping[str, EngineClient], wait_s: float = 300.0, role: str = "rollout"
    ) -> None:
        if not clients:
            raise ValueError("at least one engine is needed")
        self.wait_s = wait_s
        self.role = role  # what the engines serve, for the errors
        self._changed = threading.Condition()
        self._clients: dict[str, EngineClient] = dict(clients)
        self.names: list[str] = list(clients)
        self._draining: set[str] = set()
        self._outstanding: dict[str, int] = dict.fromkeys(clients, 0)
        # The rids of each call in flight that named them, by engine, with the order it began in.
        self._calls: dict[str, list[tuple[int, tuple[str, ...]]]] = {}
        self._began = 0

    @classmethod
    def of(cls, engines: Sequence[EngineClient] | EnginePool) -> EnginePool:
        if isinstance(engines, EnginePool):
            return engines
        return cls({f"engine-{i}": client for i, client in enumerate(engines)})

    def active(self) -> list[tuple[str, EngineClient]]:
        with self._changed:
            return [(n, c) for n, c in self._clients.items() if n not in self._draining]

    def clients(self) -> list[EngineClient]:
        """Every engine in the pool (draining ones too: they still hold weights to check)."""
        with self._changed:
            return list(self._clients.values())

    def named_clients(self) -> dict[str, EngineClient]:
        with self._changed:
            return dict(self._clients)

    @contextmanager
    def acquire(self, rids: Sequence[str] = ()) -> Iterator[tuple[int, EngineClient]]:
        """The active engine with the fewest of this pool's requests in flight (ties: the first
        by name order); waits while none is active (a migration between removing and adding).
        A call that names its ``rids`` may be shed to other engines while it runs (``shed``)."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: any(n not in self._draining for n in self._clients), timeout=self.wait_s
            ):
                raise RolloutError(f"no {self.role} engine was in service for {self.wait_s:g} s")
            name = min(
                (n for n in self._clients if n not in self._draining),
                key=lambda n: (self._outstanding[n], self.names.index(n)),
            )
            self._outstanding[name] += 1
            client = self._clients[name]
            self._began += 1
            call = (self._began, tuple(rids))
            if rids:
                self._calls.setdefault(name, []).append(call)
        try:
            yield self.names.index(name), client
        finally:
            with self._changed:
                self._outstanding[name] -= 1
                if rids:
                    self._calls[name].remove(call)
                self._changed.notify_all()

    def shed(self, names: Sequence[str], share: float) -> dict[str, list[str]]:
        """Which requests in flight on ``names`` to hand to the pool's other engines: about
        ``share`` of them, whole calls, the latest begun first (the least generated, so the
        least to prefill again), by engine. The caller aborts them on their engine; the rollout
        then resumes each where ``acquire`` sends it: the least loaded engine, a new one first."""
        with self._changed:
            calls = sorted(
                ((began, name, rids) for name in names for began, rids in self._calls.get(name, ())),
                reverse=True,
            )
            target = round(max(0.0, min(1.0, share)) * sum(len(rids) for _, _, rids in calls))
            chosen: dict[str, list[str]] = {}
            taken = 0
            for _, name, rids in calls:
                if taken >= target:
                    break
                chosen.setdefault(name, []).extend(rids)
                taken += len(rids)
            return chosen

    def drain(self, names: Sequence[str]) -> None:
        with self._changed:
            self._draining |= set(names) & set(self._clients)

    def undrain(self, names: Sequence[str]) -> None:
        with self._changed:
            self._draining -= set(names)
            self._changed.notify_all()

    def in_flight(self, names: Sequence[str]) -> int:
        with self._changed:
            return sum(self._outstanding.get(n, 0) for n in names)

    def wait_idle(self, names: Sequence[str], timeout_s: float) -> bool:
        """Until none of this pool's requests is in flight on ``names``."""
        with self._changed:
            return self._changed.wait_for(
                lambda: not any(self._outstanding.get(n, 0) for n in names), timeout=timeout_s
            )

    def add(self, clients: Mapping[str, EngineClient]) -> None:
        with self._changed:
            for name, client in clients.items():
                self._clients[name] = client
                self._outstanding.setdefault(name, 0)
                self._draining.discard(name)
                if name not in self.names:
                    self.names.append(name)
            self._changed.notify_all()

    def remove(self, names: Sequence[str]) -> list[EngineClient]:
        with self._changed:
            removed = [self._clients.pop(n) for n in names if n in self._clients]
            self._draining -= set(names)
            return removed


# A sample comes back aborted only when a migration took its engine away (nothing else aborts a
# rollout request); it is resumed elsewhere, a bounded number of times.
MAX_RESUMES = 8


@dataclass
class _Partial:
    """What one sample generated so far, over its attempts."""

    attempt: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    finish_type: str = ""
    rid: str = ""
    engine: int = -1

    def extend(self, result: GenerateResult, engine: int) -> None:
        self.output_ids += result.output_ids
        self.logprobs += result.output_logprobs
        self.versions += result.token_weight_versions()
        self.finish_type = result.finish_type
        self.rid = result.rid
        self.engine = engine


def rollout(
    engines: Sequence[EngineClient] | EnginePool,
    problems: Sequence[Problem],
    config: RLJobConfig,
    job_id: str,
    iteration: int,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    progress: RolloutProgress | None = None,
) -> list[RolloutSample]:
    """``config.group_size`` samples of every problem, prompt-major.

    Each prompt's group goes to the rollout engine with the fewest of this call's groups in
    flight, as one batch ``/generate`` (one HTTP round trip per group rather than per sample,
    and the group's shared prompt is prefilled once into the engine's prefix cache); the engines
    batch all of them continuously. Every sample has its own rid and sampling seed.

    A sample that comes back aborted (a workload migration paused its engine) is resumed on
    another engine, as slime, AReaL, RLinf and ROLL do: prompt + partial output as its
    ``input_ids``, ``max_new_tokens`` less what it already generated (finished as ``length``
    when nothing is left), under the next attempt's rid. Its tokens are the partial output
    followed by the continuation, with each token's log-prob and weight version.
    """
    pool = EnginePool.of(engines)
    prompts = [TOKENIZER.encode(problem.prompt_text, add_bos=True) for problem in problems]
    counts: dict[str, list[int]] = {}  # engine -> [samples finished, samples in flight]
    counting = threading.Lock()

    def count(engine: int, finished: int, in_flight: int) -> None:
        with counting:  # held while reporting too, so reports arrive in the order they happened
            entry = counts.setdefault(pool.names[engine], [0, 0])
            entry[0] += finished
            entry[1] += in_flight
            if progress is not None:
                progress({name: (done, done + running) for name, (done, running) in counts.items()})

    def group(prompt: int) -> list[_Partial]:
        partials = [_Partial() for _ in range(config.group_size)]
        pending = list(range(config.group_size))
        while pending:
            batch_inputs, batch_params, rids = [], [], []
            for sample in list(pending):
                partial = partials[sample]
                left = config.max_new_tokens - len(partial.output_ids)
                if left <= 0:  # its partial output already used the whole budget
                    partial.finish_type = "length"
                    pending.remove(sample)
                    continue
                params = config.sampling_params(sample_seed(config, iteration, prompt, sample))
                params["max_new_tokens"] = left
                batch_inputs.append([*prompts[prompt], *partial.output_ids])
                batch_params.append(params)
                rids.append(sample_rid(job_id, iteration, prompt, sample, partial.attempt))
            if not batch_inputs:
                break
            with pool.acquire(rids) as (engine, client):
                count(engine, 0, len(batch_inputs))
                try:
                    results = client.generate_batch(
                        batch_inputs, batch_params, rids=rids, return_logprob=True
                    )
                finally:
                    count(engine, 0, -len(batch_inputs))
            count(engine, sum(1 for result in results if not result.aborted), 0)
            if len(results) != len(batch_inputs):
                raise RolloutError(
                    f"engine {client.base_url} answered {len(results)} of {len(batch_inputs)} requests"
                )
            resumed = []
            for sample, result in zip(list(pending), results, strict=True):
                partial = partials[sample]
                if len(result.output_logprobs) != len(result.output_ids):
                    raise RolloutError(
                        f"sample {result.rid!r} has log-probs for {len(result.output_logprobs)} of "
                        f"{len(result.output_ids)} tokens"
                    )
                partial.extend(result, engine)
                if result.aborted:
                    partial.attempt += 1
                    if partial.attempt > MAX_RESUMES:
                        raise RolloutError(f"sample {result.rid!r} was aborted {partial.attempt} times")
                    resumed.append(sample)
            pending = resumed
        for partial in partials:
            if not partial.output_ids:
                raise RolloutError(f"sample {partial.rid!r} came back {partial.finish_type} with no tokens")
        return partials

    if not problems:
        return []
    with ThreadPoolExecutor(
        max_workers=min(len(problems), max_concurrency), thread_name_prefix="rollout"
    ) as workers:
        answers = list(workers.map(group, range(len(problems))))
    samples: list[RolloutSample] = []
    for prompt, partials in enumerate(answers):
        for sample, partial in enumerate(partials):
            samples.append(
                RolloutSample(
                    prompt_index=prompt,
                    sample_index=sample,
                    rid=partial.rid,
                    engine=partial.engine,
                    prompt_ids=tuple(prompts[prompt]),
                    response_ids=tuple(partial.output_ids),
                    logprobs=tuple(partial.logprobs),
                    weight_versions=tuple(partial.versions),
                    finish_type=partial.finish_type,
                    text=TOKENIZER.decode(partial.output_ids),
                    attempts=partial.attempt + 1,
                )
            )
    return samples


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
) -> IterationReport:
    """One iteration of the job: generate ``group_size`` responses to each of the iteration's
    problems on the rollout ``engines``, score them, ask the reference for its log-probs (only
    when the KL term is on), take one trainer step on the global batch, push the new weights
    and check that every rollout engine reports them."""
    if reference is None and config.grpo.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs a reference scorer")
    problems = iteration_problems(config, iteration)
    started = time.perf_counter()
    pool = EnginePool.of(engines)
    samples = rollout(pool, problems, config, job_id, iteration, progress=progress)
    generated = time.perf_counter()
    rewards = reward.score([(problems[s.prompt_index], s.text) for s in samples])
    rewarded = time.perf_counter()
    reference_logprobs = None
    if config.grpo.kl_coef > 0 and reference is not None:
        reference_logprobs = reference.response_logprobs([(s.prompt_ids, s.response_ids) for s in samples])
    referenced = time.perf_counter()
    metrics = trainer.train_step(build_trajectories(samples, rewards, reference_logprobs, iteration))
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
        tokens_trained=metrics.grpo.response_tokens,
        samples_per_engine=tuple(engine_counts.get(index, 0) for index in range(len(pool.names))),
        seconds=PhaseSeconds(
            generate=generated - started,
            reward=rewarded - generated,
            reference=referenced - rewarded,
            train=trained - referenced,
            push=pushed - trained,
            verify=verified - pushed,
        ),
        loss=metrics.grpo.loss,
        policy_loss=metrics.grpo.policy_loss,
        kl=metrics.grpo.kl if reference_logprobs is not None else None,
        clip_fraction=metrics.grpo.clip_fraction,
        grad_norm=metrics.grad_norm,
        stale_token_fraction=metrics.stale_token_fraction,
        resumed_samples=sum(1 for sample in samples if sample.attempts > 1),
    )
