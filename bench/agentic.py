"""The agentic variant's rollout under priority routing and under FIFO, on real CPU engines.

    .venv/bin/python -m bench.agentic                       # the defaults below
    .venv/bin/python -m bench.agentic --cache-tokens 256 --tool-latency 0.05 --max-terms 6

Each routing gets fresh engines (cold prefix caches) serving the same warm-started policy, and
rolls out the same iterations' problems: ``--prompts`` x ``--group`` episodes of calculator
calls each (`runtime.rl.agentic`). Every turn's seed is fixed, so both routings generate the
same transcripts; what differs is where each turn runs and so what the engines' prefix caches
give back. The table is what the engines reported (``cached_tokens`` per request) and the wall
time of the rollouts: medians over ``--repeats`` runs per routing, the routings alternated.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from runtime.engine.client import EngineClient
from runtime.engine.cpu_engine import CpuEngine
from runtime.engine.cpu_server import CpuEngineServer
from runtime.engine.model import gpt_from_weights
from runtime.model.config import GPTConfig
from runtime.rl.agentic import AgenticSettings, AgenticStats, AgentLoop, Routing
from runtime.rl.job import RLJobConfig, iteration_problems
from runtime.rl.rollout import EnginePool, RolloutSample
from runtime.rl.warm_start import warm_start_weights
from runtime.task.arithmetic import TaskConfig, score
from runtime.task.calculator import Calculator
from runtime.task.tokenizer import CharTokenizer

TIMEOUT_S = 300.0


@dataclasses.dataclass
class RoutingResult:
    routing: Routing
    seconds: float
    stats: list[AgenticStats]
    samples: list[RolloutSample]
    rewards: list[float]

    def total(self, field: str) -> int:
        return sum(int(getattr(stats, field)) for stats in self.stats)

    @property
    def policy_tokens(self) -> int:
        return sum(sum(sample.trained or ()) for sample in self.samples)


def job_config(args: argparse.Namespace) -> RLJobConfig:
    task = TaskConfig(
        max_digits=args.max_digits, zipf_exponent=args.zipf, calculator=True, max_terms=args.max_terms
    )
    longest_prompt = 1 + task.longest_prompt_chars()
    return RLJobConfig(
        model=GPTConfig(
            vocab_size=CharTokenizer().vocab_size,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            ffn_hidden_size=128,
            max_positions=longest_prompt + args.max_new_tokens,
        ),
        task=task,
        seed=args.seed,
        iterations=args.iterations,
        prompts_per_iteration=args.prompts,
        group_size=args.group,
        max_new_tokens=args.max_new_tokens,
        warm_start_steps=args.warm_start_steps,
    )


@contextmanager
def engines(
    config: RLJobConfig, weights: dict[str, torch.Tensor], count: int, cache_tokens: int, slots: int
) -> Iterator[EnginePool]:
    settings = dataclasses.replace(
        config.engine_settings(max_running_requests=slots), prefix_cache_tokens=cache_tokens
    )
    with ExitStack() as stack:
        clients: dict[str, EngineClient] = {}
        for index in range(count):
            engine = CpuEngine(config.model, settings, model=gpt_from_weights(config.model, weights))
            server = CpuEngineServer(engine, port=0)
            server.start()
            stack.callback(server.stop)
            client = EngineClient(server.url, timeout_s=TIMEOUT_S, generate_timeout_s=TIMEOUT_S)
            stack.callback(client.close)
            clients[f"engine-{index}"] = client
        yield EnginePool(clients)


def run_routing(
    routing: Routing, config: RLJobConfig, weights: dict[str, torch.Tensor], args: argparse.Namespace
) -> RoutingResult:
    settings = AgenticSettings(
        routing=routing, slots_per_engine=args.slots, affinity_wait_s=args.affinity_wait
    )
    agent = AgentLoop(Calculator(latency_s=args.tool_latency), settings)
    stats: list[AgenticStats] = []
    samples: list[RolloutSample] = []
    rewards: list[float] = []
    with engines(config, weights, args.engines, args.cache_tokens, args.slots) as pool:
        started = time.perf_counter()
        for iteration in range(args.iterations):
            problems = iteration_problems(config, iteration)
            rolled, iteration_stats = agent.rollout(pool, problems, config, "bench", iteration)
            stats.append(iteration_stats)
            samples += rolled
            rewards += [score(problems[s.prompt_index], s.text) for s in rolled]
        seconds = time.perf_counter() - started
    return RoutingResult(routing, seconds, stats, samples, rewards)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def table(runs: dict[Routing, list[RoutingResult]]) -> str:
    """Per routing, the median over its repeats (wall time with its range)."""
    rows = [
        "| routing | wall s (range) | episodes/s | policy tokens/s | turns | tool calls | context tokens sent "
        "| from prefix cache | re-prefilled | affinity hits | order at end | mean reward |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for routing, results in runs.items():
        first = results[0]
        seconds = [r.seconds for r in results]
        sent = first.total("prompt_tokens")
        cached = median([r.total("cached_tokens") for r in results])
        rows.append(
            f"| {routing} | {median(seconds):.2f} ({min(seconds):.2f}-{max(seconds):.2f}) "
            f"| {median([r.total('episodes') / r.seconds for r in results]):.1f} "
            f"| {median([r.policy_tokens / r.seconds for r in results]):.0f} | {first.total('turns')} "
            f"| {first.total('tool_calls')} | {sent} | {cached:.0f} ({cached / max(sent, 1):.0%}) "
            f"| {median([r.total('reprefilled_tokens') for r in results]):.0f} "
            f"| {median([sum(s.router.affinity_hits for s in r.stats) for r in results]):.0f} "
            f"| {first.stats[-1].router.mode_now} | {sum(first.rewards) / len(first.rewards):.3f} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="turns one engine runs at once")
    parser.add_argument("--cache-tokens", type=int, default=512, help="each engine's prefix-cache budget")
    parser.add_argument("--tool-latency", type=float, default=0.02, help="seconds per calculator call")
    parser.add_argument(
        "--affinity-wait",
        type=float,
        default=AgenticSettings().affinity_wait_s,
        help="priority: seconds a follow-up turn waits for the engine holding its prefix",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per routing, alternated; medians shown")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-digits", type=int, default=2)
    parser.add_argument("--max-terms", type=int, default=5)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--warm-start-steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm-start-cache", type=Path, default=Path(tempfile.gettempdir()) / "dynarl-warm-start"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    config = job_config(args)
    started = time.perf_counter()
    weights = warm_start_weights(config, args.warm_start_cache)
    print(f"warm start: {time.perf_counter() - started:.1f} s (cached under {args.warm_start_cache})")
    runs: dict[Routing, list[RoutingResult]] = {Routing.PRIORITY: [], Routing.FIFO: []}
    for _ in range(args.repeats):
        for routing in runs:
            runs[routing].append(run_routing(routing, config, weights, args))
    transcripts = {tuple(s.response_ids for s in r.samples) for results in runs.values() for r in results}
    same = len(transcripts) == 1
    print(
        f"{args.engines} engines x {args.slots} slots, prefix cache {args.cache_tokens} tokens each, "
        f"tool latency {args.tool_latency:g} s, {args.iterations} x {args.prompts} x {args.group} episodes "
        f"of 2..{args.max_terms} terms, {args.repeats} runs per routing; same transcripts in every run: {same}"
    )
    print(table(runs))


if __name__ == "__main__":
    main()
