"""The agentic rollout: multi-turn episodes with calculator calls, dispatched by the DataRouter.

Each sample is an *episode*. A turn sends the episode's whole context (prompt, every earlier turn
and every tool answer) to a rollout engine; the turn stops at EOS, at the budget, or where the
model ends a tool call (``=``). A tool call goes to the ``tool`` workers (`ToolCaller`), whose
answer is appended to the context, masked out of the loss (`Trajectory.trained`) and
versionless; the next turn is queued in the DataRouter (DynaRL's Algorithm 2,
`runtime.rl.router`).

Dispatch. Each engine takes at most ``slots_per_engine`` turns at a time; whenever an engine has
a free slot it asks the router for its next request:

- ``priority`` routing: more completed tool calls first, then the longer KV prefix, and a turn
  goes back to the engine that served the episode's last turn (its prefix is in that engine's
  cache) unless that engine stays busy past ``affinity_wait_s``; the router falls back to FIFO
  order by itself while later turns are not shorter;
- ``fifo`` routing: arrival order, any engine with a free slot (what a rollout without a router
  does).

KV reuse is measured by the engines: each answer says how many of its prompt tokens came from
the prefix cache (``cached_tokens``). A turn's *re-prefilled* tokens are those of its context
that an engine had computed for an earlier turn of the episode but had to compute again (the
cache on the engine it reached no longer held them, or never did).

Workload migrations act on the same `EnginePool` as the single-turn rollout: a drained engine
gets no new turn, and a turn aborted on it comes back with its partial output, is queued again
with the rest of its budget and, its engine leaving, with no affinity.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from runtime.engine.client import GenerateResult
from runtime.rl.job import RLJobConfig, sample_rid, sample_seed
from runtime.rl.rollout import (
    MAX_RESUMES,
    TOKENIZER,
    EngineGoneError,
    EnginePool,
    RolloutError,
    RolloutProgress,
    RolloutSample,
)
from runtime.rl.router import DataRouter, RoutedRequest, RouterMode, RouterStats
from runtime.task.arithmetic import TOOL_CALL_END, Problem
from runtime.task.calculator import ToolCallError

TOOL_CALL_END_ID = TOKENIZER.encode(TOOL_CALL_END)[0]


class ToolCaller(Protocol):
    def call(self, expression: str) -> str:
        """The tool's answer to ``expression``, as text appended to the episode; raises
        `ToolCallError` for an expression the tool refuses."""
        ...


class Routing(StrEnum):
    PRIORITY = "priority"
    FIFO = "fifo"


@dataclass(frozen=True)
class AgenticSettings:
    routing: Routing = Routing.PRIORITY
    slots_per_engine: int = 16
    affinity_wait_s: float = 2.0
    max_wait_s: float = 30.0
    # An engine this many turns less busy than another takes the turns waiting for it (SGLang's
    # cache-aware router's ``balance_abs_threshold``): engines that join mid-rollout get work.
    balance_abs_threshold: int = 32
    # How often the dispatcher looks again without a turn finishing (an affinity may expire).
    poll_s: float = 0.02

    def __post_init__(self) -> None:
        if self.slots_per_engine < 1:
            raise ValueError(f"slots_per_engine must be at least 1, got {self.slots_per_engine}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s must be positive, got {self.poll_s}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must not be negative, got {self.balance_abs_threshold}")

    @classmethod
    def for_job(cls, config: RLJobConfig, slots_per_engine: int) -> AgenticSettings:
        return cls(routing=Routing(config.routing), slots_per_engine=slots_per_engine)

    def new_router(self) -> DataRouter:
        """A router for a job's rollout group; it lives as long as the job (its turn-length
        statistics decide priority against FIFO)."""
        if self.routing is Routing.FIFO:
            return DataRouter(mode=RouterMode.FIFO, use_affinity=False, max_wait_s=self.max_wait_s)
        return DataRouter(
            mode=RouterMode.PRIORITY,
            affinity_wait_s=self.affinity_wait_s,
            max_wait_s=self.max_wait_s,
            balance_abs_threshold=self.balance_abs_threshold,
        )


@dataclass(frozen=True)
class AgenticStats:
    """One agentic rollout's turns, tool calls and KV reuse (summed over every request)."""

    episodes: int
    turns: int
    tool_calls: int
    tool_errors: int
    prompt_tokens: int  # context tokens sent to the engines, over every turn
    cached_tokens: int  # of them, served from an engine's prefix cache
    reprefilled_tokens: int  # of them, computed for an earlier turn and computed again
    router: RouterStats


@dataclass
class _Episode:
    prompt: int
    sample: int
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    turn: int = 0
    turn_start: int = 0  # where the current turn's own tokens begin in ``response``
    requests: int = 0  # requests sent, so every turn and every resume gets its own rid
    resumes: int = 0
    tool_calls: int = 0
    # Context tokens some engine has computed KV for (the last sampled token never is).
    computed: int = 0
    finish_type: str = ""
    rid: str = ""
    engine: int = -1

    @property
    def key(self) -> str:
        return f"p{self.prompt}-s{self.sample}"

    @property
    def context(self) -> list[int]:
        return [*self.prompt_ids, *self.response]

    def add_generated(self, result: GenerateResult, engine: int) -> None:
        self.response += result.output_ids
        self.logprobs += result.output_logprobs
        self.versions += result.token_weight_versions()
        self.trained += [True] * len(result.output_ids)
        self.rid = result.rid
        self.engine = engine
        self.finish_type = result.finish_type

    def add_tool_answer(self, ids: Sequence[int]) -> None:
        self.response += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [None] * len(ids)
        self.trained += [False] * len(ids)

    def sample_row(self) -> RolloutSample:
        return RolloutSample(
            prompt_index=self.prompt,
            sample_index=self.sample,
            rid=self.rid,
            engine=self.engine,
            prompt_ids=tuple(self.prompt_ids),
            response_ids=tuple(self.response),
            logprobs=tuple(self.logprobs),
            weight_versions=tuple(self.versions),
            finish_type=self.finish_type,
            text=TOKENIZER.decode(self.response),
            attempts=self.resumes + 1,
            trained=tuple(self.trained),
            tool_calls=self.tool_calls,
        )


class _Counters:
    def __init__(self) -> None:
        self.turns = 0
        self.tool_calls = 0
        self.tool_errors = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.reprefilled_tokens = 0


class AgentLoop:
    """A job's agentic rollout: its tool, its dispatch settings and its router, which lives as
    long as the job (its turn-length statistics decide priority against FIFO)."""

    def __init__(self, tool: ToolCaller, settings: AgenticSettings = AgenticSettings()) -> None:
        self.tool = tool
        self.settings = settings
        self.router = settings.new_router()

    def rollout(
        self,
        engines: EnginePool,
        problems: Sequence[Problem],
        config: RLJobConfig,
        job_id: str,
        iteration: int,
        progress: RolloutProgress | None = None,
    ) -> tuple[list[RolloutSample], AgenticStats]:
        return agentic_rollout(
            engines, problems, config, job_id, iteration, self.tool, self.router, self.settings, progress
        )


def agentic_rollout(
    engines: EnginePool,
    problems: Sequence[Problem],
    config: RLJobConfig,
    job_id: str,
    iteration: int,
    tool: ToolCaller,
    router: DataRouter,
    settings: AgenticSettings = AgenticSettings(),
    progress: RolloutProgress | None = None,
) -> tuple[list[RolloutSample], AgenticStats]:
    """``config.group_size`` episodes of every problem, prompt-major, and what they cost.

    ``router`` is the job's (see `AgenticSettings.new_router`); this call sets its workers to
    the pool's engines in service as they change."""
    if not config.task.calculator:
        raise ValueError("the agentic rollout runs calculator tasks (RLJobConfig.task.calculator)")
    pool = engines
    episodes = [
        _Episode(prompt, sample, TOKENIZER.encode(problem.prompt_text, add_bos=True))
        for prompt, problem in enumerate(problems)
        for sample in range(config.group_size)
    ]
    changed = threading.Condition()  # guards the router, the counts below and ``failures``
    counters = _Counters()
    outstanding: dict[str, int] = {}
    finished_on: dict[str, int] = {}
    failures: list[BaseException] = []
    done = 0

    def queue(episode: _Episode, *, taken_back: bool = False) -> None:
        """Queue the episode's next request (lock held)."""
        request = RoutedRequest(
            request_id=sample_rid(job_id, iteration, episode.prompt, episode.sample, episode.requests),
            episode_id=episode.key,
            completed_tool_calls=episode.tool_calls,
            prefix_tokens=episode.computed,
            enqueued_at=time.monotonic(),
            payload=episode,
        )
        episode.requests += 1
        if taken_back:
            router.take_back([request])
        else:
            router.submit(request)

    def report() -> None:
        if progress is not None:  # lock held: reports arrive in the order things happened
            names = set(finished_on) | set(outstanding)
            progress(
                {n: (finished_on.get(n, 0), finished_on.get(n, 0) + outstanding.get(n, 0)) for n in names}
            )

    def finish(episode: _Episode, name: str) -> None:
        nonlocal done
        router.forget_episode(episode.key)
        finished_on[name] = finished_on.get(name, 0) + 1
        done += 1

    def run_turn(request: RoutedRequest, name: str) -> None:
        episode: _Episode = request.payload
        try:
            left = config.max_new_tokens - len(episode.response)
            params = config.sampling_params(
                sample_seed(config, iteration, episode.prompt, episode.sample, episode.requests)
            )
            params["max_new_tokens"] = left
            context = episode.context
            try:
                held = pool.use(name, [request.request_id])
            except EngineGoneError:  # a migration removed it after the dispatch: queue again
                with changed:
                    queue(episode, taken_back=True)
                return
            with held as (engine, client):
                result = client.generate(context, params, rid=request.request_id, return_logprob=True)
            if len(result.output_logprobs) != len(result.output_ids):
                raise RolloutError(
                    f"turn {result.rid!r} has log-probs for {len(result.output_logprobs)} of "
                    f"{len(result.output_ids)} tokens"
                )
            step_tokens(episode, result, engine, name, len(context))
        except BaseException as error:
            with changed:
                failures.append(error)
        finally:
            with changed:
                outstanding[name] -= 1
                report()
                changed.notify_all()

    def step_tokens(episode: _Episode, result: GenerateResult, engine: int, name: str, sent: int) -> None:
        reprefilled = max(0, episode.computed - result.cached_tokens)
        episode.add_generated(result, engine)
        episode.computed = sent + max(0, len(result.output_ids) - 1)
        with changed:
            counters.prompt_tokens += sent
            counters.cached_tokens += result.cached_tokens
            counters.reprefilled_tokens += reprefilled
        if result.aborted:  # a workload migration took the engine away: resume elsewhere
            episode.resumes += 1
            if episode.resumes > MAX_RESUMES:
                raise RolloutError(f"episode {episode.key!r} was aborted {episode.resumes} times")
            with changed:
                if len(episode.response) >= config.max_new_tokens:  # nothing left to generate
                    episode.finish_type = "length"
                    finish(episode, name)
                else:
                    queue(episode, taken_back=True)
            return
        turn_tokens = len(episode.response) - episode.turn_start
        called = bool(result.output_ids) and result.output_ids[-1] == TOOL_CALL_END_ID
        answer: list[int] | None = None
        if called and result.finish_type == "stop":
            # The call is the turn's last line up to the "=".
            line = TOKENIZER.decode(episode.response[episode.turn_start : -1]).rsplit("\n", 1)[-1]
            try:
                answer = TOKENIZER.encode(tool.call(line))
            except ToolCallError:
                answer = None
            with changed:
                counters.tool_calls += 1
                counters.tool_errors += answer is None
        with changed:
            counters.turns += 1
            router.note_turn_length(episode.turn, turn_tokens)
            if answer is None:  # EOS, the budget, or a call the tool refused: the episode ends
                finish(episode, name)
                return
            episode.tool_calls += 1
            room = config.max_new_tokens - len(episode.response)
            episode.add_tool_answer(answer[:room])
            if len(answer) >= room:
                episode.finish_type = "length"
                finish(episode, name)
                return
            episode.turn += 1
            episode.turn_start = len(episode.response)
            queue(episode)

    before = router.stats
    if not episodes:
        return [], _stats(episodes, counters, router, before)
    with changed:
        for episode in episodes:
            queue(episode)
    members: frozenset[str] = frozenset()
    idle_since: float | None = None
    # Threads only wait on HTTP and tools; the slots bound how many run at once.
    executor = ThreadPoolExecutor(max_workers=1024, thread_name_prefix="agentic")
    try:
        with changed:
            while done < len(episodes) and not failures:
                now = time.monotonic()
                active = [name for name, _ in pool.active()]
                if frozenset(active) != members:
                    members = frozenset(active)
                    router.set_workers(active)
                if not active:
                    idle_since = idle_since if idle_since is not None else now
                    if now - idle_since > pool.wait_s:
                        raise RolloutError(f"no rollout engine was in service for {pool.wait_s:g} s")
                else:
                    idle_since = None
                # One request at a time to the least busy engine, until none gets one.
                dispatched = True
                any_dispatched = False
                while dispatched:
                    dispatched = False
                    for name in sorted(active, key=lambda n: outstanding.get(n, 0)):
                        if outstanding.get(name, 0) >= settings.slots_per_engine:
                            continue
                        request = router.next_for_worker(name, now, outstanding)
                        if request is None:
                            continue
                        outstanding[name] = outstanding.get(name, 0) + 1
                        executor.submit(run_turn, request, name)
                        dispatched = any_dispatched = True
                if any_dispatched:
                    report()  # once per pass, not per request
                changed.wait(timeout=settings.poll_s)
            if failures:
                raise failures[0]
    finally:
        # On a failure the turns in flight finish and none queued in the executor starts.
        executor.shutdown(wait=True, cancel_futures=True)
    return [episode.sample_row() for episode in episodes], _stats(episodes, counters, router, before)


def _stats(
    episodes: Sequence[_Episode], counters: _Counters, router: DataRouter, before: RouterStats
) -> AgenticStats:
    """This rollout's counts; the router's counters run over the job, so only their growth."""
    now = router.stats
    return AgenticStats(
        episodes=len(episodes),
        turns=counters.turns,
        tool_calls=counters.tool_calls,
        tool_errors=counters.tool_errors,
        prompt_tokens=counters.prompt_tokens,
        cached_tokens=counters.cached_tokens,
        reprefilled_tokens=counters.reprefilled_tokens,
        router=dataclasses.replace(
            now,
            dispatched=now.dispatched - before.dispatched,
            affinity_hits=now.affinity_hits - before.affinity_hits,
            affinity_fallbacks=now.affinity_fallbacks - before.affinity_fallbacks,
            affinity_steals=now.affinity_steals - before.affinity_steals,
            starvation_promotions=now.starvation_promotions - before.starvation_promotions,
        ),
    )
