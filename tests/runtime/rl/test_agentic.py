"""The agentic rollout on real CPU engines: multi-turn episodes, calculator calls, the
DataRouter's dispatch and the engines' prefix caches, a workload move mid-episode, and an
iteration that trains on the policy's tokens only."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from runtime.engine.model import gpt_from_weights
from runtime.model.config import GPTConfig
from runtime.rl.agentic import AgenticSettings, AgenticStats, AgentLoop, Routing
from runtime.rl.grpo import GRPOConfig
from runtime.rl.job import RLJobConfig, iteration_problems
from runtime.rl.loop import run_iteration
from runtime.rl.rollout import EnginePool, RolloutSample
from runtime.rl.warm_start import warm_start_weights
from runtime.task.arithmetic import TOOL_CALL_END, TaskConfig
from runtime.task.calculator import Calculator
from runtime.task.tokenizer import CharTokenizer
from tests.runtime.rl.local_job import TIMEOUT_S, local_job
from tests.services import wait_until

torch.set_num_threads(1)
TOKENIZER = CharTokenizer()
CALCULATOR = Calculator(latency_s=0.005)

CONFIG = RLJobConfig(
    model=GPTConfig(
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        ffn_hidden_size=64,
        max_positions=64,
    ),
    task=TaskConfig(max_digits=2, calculator=True, max_terms=4),
    seed=3,
    iterations=2,
    prompts_per_iteration=6,
    group_size=4,
    max_new_tokens=44,
    learning_rate=1e-3,
    micro_batch_size=8,
    grpo=GRPOConfig(kl_coef=0.05),
    warm_start_steps=300,
    warm_start_batch_size=16,
)
EPISODES = CONFIG.prompts_per_iteration * CONFIG.group_size
# Affinity never expires within a test: every follow-up turn waits for its engine.
STICKY = AgenticSettings(routing=Routing.PRIORITY, slots_per_engine=4, affinity_wait_s=600.0)


def segments(sample: RolloutSample) -> list[tuple[bool, str]]:
    """The response cut where the author changes: (the policy's?, text) runs."""
    assert sample.trained is not None
    runs: list[tuple[bool, list[int]]] = []
    for token, trained in zip(sample.response_ids, sample.trained, strict=True):
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return [(trained, TOKENIZER.decode(tokens, stop_at_eos=False)) for trained, tokens in runs]


def assert_episodes_are_whole(
    samples: Sequence[RolloutSample], stats: AgenticStats, model: torch.nn.Module
) -> None:
    """Every episode once, in order; each tool answer is the calculator's for the call before it;
    the policy's tokens carry the log-probs of a cache-free forward of the whole transcript (so
    every turn saw every earlier turn and tool answer), tool tokens none."""
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, s) for p in range(CONFIG.prompts_per_iteration) for s in range(CONFIG.group_size)
    ]
    assert len({s.rid for s in samples}) == len(samples)
    calls = 0
    for sample in samples:
        runs = segments(sample)
        assert runs[0][0], "an episode starts with the policy's tokens"
        for (_, said), (trained, answer) in itertools.pairwise(runs):
            if not trained:
                assert said.endswith(TOOL_CALL_END)
                expression = said[: -len(TOOL_CALL_END)].rsplit("\n", 1)[-1]
                assert CALCULATOR.call(expression).startswith(answer)  # whole, unless the budget cut it
                calls += 1
        assert sample.tool_calls == sum(1 for trained, _ in runs if not trained)
        sequence = [*sample.prompt_ids, *sample.response_ids]
        log_probs = torch.log_softmax(model.full_logits(sequence), dim=-1)
        assert sample.trained is not None
        for index, (token, trained) in enumerate(zip(sample.response_ids, sample.trained, strict=True)):
            if trained:
                expected = float(log_probs[len(sample.prompt_ids) + index - 1, token])
                assert sample.logprobs[index] == pytest.approx(expected, abs=1e-4)
                assert sample.weight_versions[index] is not None
            else:
                assert sample.logprobs[index] == 0.0 and sample.weight_versions[index] is None
        assert len(sample.response_ids) <= CONFIG.max_new_tokens
    assert stats.episodes == EPISODES
    assert stats.tool_calls - stats.tool_errors == calls
    # A turn per tool answer, and the one that ended the episode.
    assert stats.turns == EPISODES + calls
    assert stats.cached_tokens + stats.reprefilled_tokens <= stats.prompt_tokens


@pytest.fixture(scope="module")
def weights(warm_start_cache: Path) -> dict[str, torch.Tensor]:
    return warm_start_weights(CONFIG, warm_start_cache)


def test_priority_routing_keeps_each_episode_on_the_engine_holding_its_prefix(
    weights: dict[str, torch.Tensor],
) -> None:
    problems = iteration_problems(CONFIG, 0)
    model = gpt_from_weights(CONFIG.model, weights)
    with local_job(CONFIG, weights, rollout_engines=2) as job:
        pool = EnginePool({"a": job.engines[0], "b": job.engines[1]})
        seen: list[dict[str, tuple[int, int]]] = []
        samples, stats = AgentLoop(CALCULATOR, STICKY).rollout(
            pool, problems, CONFIG, "job1", 0, progress=seen.append
        )
        block = job.servers[0].engine.prefix_cache.block_size
    assert_episodes_are_whole(samples, stats, model)
    follow_ups = stats.turns - EPISODES
    assert follow_ups > 0, "the warm-started policy made no tool call"
    # Each follow-up turn went where the episode's last turn ran, and that engine's cache gave
    # back all of the context it had computed except a partial last block.
    assert stats.router.affinity_hits == follow_ups
    assert stats.router.affinity_steals == stats.router.affinity_fallbacks == 0
    assert stats.reprefilled_tokens < block * follow_ups
    assert stats.cached_tokens > 0
    # Progress per engine: finished episodes never exceed those finished or in flight; all end.
    assert all(done <= assigned for snapshot in seen for done, assigned in snapshot.values())
    assert sum(done for done, _ in seen[-1].values()) == EPISODES


def test_fifo_routing_changes_where_turns_run_never_what_they_say(weights: dict[str, torch.Tensor]) -> None:
    """Each turn has its own sampling seed, so the episodes are the same whichever engine serves
    each turn: FIFO dispatch without affinity gives the transcripts priority routing gives."""
    problems = iteration_problems(CONFIG, 0)
    with local_job(CONFIG, weights, rollout_engines=2) as job:
        pool = EnginePool({"a": job.engines[0], "b": job.engines[1]})
        sticky, _ = AgentLoop(CALCULATOR, STICKY).rollout(pool, problems, CONFIG, "job1", 0)
        fifo_settings = AgenticSettings(routing=Routing.FIFO, slots_per_engine=4)
        fifo, stats = AgentLoop(CALCULATOR, fifo_settings).rollout(pool, problems, CONFIG, "job1", 0)
    assert stats.router.affinity_hits == 0 and stats.router.mode_now == "fifo"
    assert [s.response_ids for s in fifo] == [s.response_ids for s in sticky]
    assert [s.trained for s in fifo] == [s.trained for s in sticky]


def test_a_workload_move_mid_episode_resumes_every_turn_elsewhere_once(
    weights: dict[str, torch.Tensor],
) -> None:
    """Engine a is drained and paused (abort) while episodes run on it, as a workload
    migration's pause does: its turns come back with their partial output and finish on b."""
    problems = iteration_problems(CONFIG, 0)
    model = gpt_from_weights(CONFIG.model, weights)
    with local_job(CONFIG, weights, rollout_engines=2) as job:
        pool = EnginePool({"a": job.engines[0], "b": job.engines[1]})
        job.engines[0].slow_down(0.02)  # long enough to be caught mid-turn
        agent = AgentLoop(CALCULATOR, STICKY)
        with ThreadPoolExecutor(1) as runner:
            running = runner.submit(agent.rollout, pool, problems, CONFIG, "job1", 0)
            engine = job.servers[0].engine
            assert wait_until(lambda: engine.state()["generated_tokens"] >= 20, timeout_s=TIMEOUT_S)
            pool.drain(["a"])
            job.engines[0].pause_generation("abort")
            samples, stats = running.result(TIMEOUT_S)
        assert pool.wait_idle(["a"], 1.0)
        pool.remove(["a"])
    assert_episodes_are_whole(samples, stats, model)
    resumed = [s for s in samples if s.attempts > 1]
    assert resumed, "nothing was in flight on the paused engine"
    assert all(s.engine == 1 for s in resumed)
    # The episodes whose cache holder left were dispatched without it.
    assert stats.router.affinity_fallbacks >= 1


def test_an_engine_that_joins_mid_rollout_takes_follow_up_turns_from_the_busy_one(
    weights: dict[str, torch.Tensor],
) -> None:
    # Every episode starts on engine a; b joins once a has run a few turns (a move to the
    # rollout landing mid-batch). With affinity that never expires every follow-up turn would go
    # back to a, which has room for it; out of balance by more than 2 turns, b takes them.
    problems = iteration_problems(CONFIG, 0)
    model = gpt_from_weights(CONFIG.model, weights)
    balanced = dataclasses.replace(STICKY, slots_per_engine=EPISODES, balance_abs_threshold=2)
    with local_job(CONFIG, weights, rollout_engines=2) as job:
        pool = EnginePool({"a": job.engines[0]})
        job.engines[0].slow_down(0.01)
        with ThreadPoolExecutor(1) as runner:
            running = runner.submit(
                AgentLoop(CALCULATOR, balanced).rollout, pool, problems, CONFIG, "job1", 0
            )
            engine = job.servers[0].engine
            assert wait_until(lambda: engine.state()["generated_tokens"] >= 20, timeout_s=TIMEOUT_S)
            pool.add({"b": job.engines[1]})
            samples, stats = running.result(TIMEOUT_S)
    assert_episodes_are_whole(samples, stats, model)
    # Turns that b took from a, each re-prefilled there; the episodes moved stay with b.
    assert stats.router.affinity_steals > 0
    assert any(s.engine == 1 for s in samples)
    assert stats.router.affinity_fallbacks == 0


def test_an_agentic_iteration_trains_on_the_policys_tokens_only(weights: dict[str, torch.Tensor]) -> None:
    with local_job(CONFIG, weights, rollout_engines=2) as job:
        with pytest.raises(ValueError, match="agent loop"):
            run_iteration(CONFIG, "job1", 0, job.engines, job.reward, job.reference, job.group)
        agent = AgentLoop(CALCULATOR, STICKY)
        report = run_iteration(
            CONFIG, "job1", 0, job.engines, job.reward, job.reference, job.group, agent=agent
        )
        samples, _ = AgentLoop(CALCULATOR, STICKY).rollout(
            EnginePool.of(job.engines), iteration_problems(CONFIG, 1), CONFIG, "job1", 1
        )
        two_term = dataclasses.replace(CONFIG, task=TaskConfig(max_digits=2))
        with pytest.raises(ValueError, match="agent loop"):
            run_iteration(two_term, "job2", 0, job.engines, job.reward, job.reference, job.group, agent=agent)
    assert report.trainer_step == 1 and report.kl is not None
    assert report.agentic is not None
    assert report.agentic.tool_calls > 0 and report.agentic.turns > EPISODES
    # Trained tokens are the policy's: the tool answers are in tokens_generated, not trained.
    assert report.tokens_trained < report.tokens_generated
    # The engines were pushed the new weights: the next rollout samples under version 1.
    assert {v for s in samples for v in s.weight_versions if v is not None} == {report.weight_version}
