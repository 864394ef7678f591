"""The rollout: every sample of an iteration generated on the rollout engines, through an
`EnginePool` that a workload migration may change while requests run.

`rollout` sends each prompt's group as one batch; `runtime.rl.agentic` runs multi-turn episodes
with tool calls through the DataRouter. Both return `RolloutSample` rows and resume a sample
that a migration aborted on another engine after its partial output.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

from runtime.engine.client import EngineClient, GenerateResult
from runtime.rl.job import RLJobConfig, sample_rid, sample_seed
from runtime.task.arithmetic import Problem
from runtime.task.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer()
# Groups in flight at once from one rollout call: enough to fill every engine's running batch,
# few enough that the client's threads stay cheap.
DEFAULT_MAX_CONCURRENCY = 64


class RolloutError(RuntimeError):
    """The rollout did not produce a usable sample (an aborted or empty response)."""


class EngineGoneError(RolloutError):
    """The engine a caller chose has left the pool (a migration removed it)."""


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
    # An agentic episode's response also holds its tools' answers: which tokens are the policy's
    # (None: all), and how many tool calls it made.
    trained: tuple[bool, ...] | None = None
    tool_calls: int = 0

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
            call = self._begin(name, rids)
            client = self._clients[name]
        with self._held(name, client, call) as held:
            yield held

    def use(self, name: str, rids: Sequence[str] = ()) -> AbstractContextManager[tuple[int, EngineClient]]:
        """Hold the engine ``name`` that the caller chose itself (a router's dispatch), counted
        and sheddable as ``acquire``'s are."""
        with self._changed:
            if name not in self._clients:
                raise EngineGoneError(f"{self.role} engine {name!r} is not in the pool")
            call = self._begin(name, rids)
            client = self._clients[name]
        return self._held(name, client, call)

    def _begin(self, name: str, rids: Sequence[str]) -> tuple[int, tuple[str, ...]]:
        """Count a call on ``name`` (lock held)."""
        self._outstanding[name] += 1
        self._began += 1
        call = (self._began, tuple(rids))
        if rids:
            self._calls.setdefault(name, []).append(call)
        return call

    @contextmanager
    def _held(
        self, name: str, client: EngineClient, call: tuple[int, tuple[str, ...]]
    ) -> Iterator[tuple[int, EngineClient]]:
        try:
            yield self.names.index(name), client
        finally:
            with self._changed:
                self._outstanding[name] -= 1
                if call[1]:
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
