"""Traces: one record per episode (one sampled response of a prompt, all its turns).

A trace carries everything random about a workload (lengths, tool latencies, verifier times), so a
run replayed from a written trace equals the run on the generator's records. The JSONL format is
documented in docs/trace-format.md.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.core.sim.workloads import Workload, WorkloadKind

TRACE_FORMAT = "dynarl-trace"
TRACE_VERSION = 1
UNASSIGNED_ITERATION = -1  # a record without "iteration": batched in file order


class TraceFormatError(ValueError):
    """A trace line is not a valid record; the message names the line and the field."""


@dataclass(frozen=True)
class TraceRecord:
    episode_id: str
    prompt_id: str
    iteration: int
    prompt_tokens: int
    response_tokens: tuple[int, ...]  # one entry per turn
    tool_latency_s: tuple[float, ...] = ()  # one per tool call: turns - 1 entries
    tool_output_tokens: tuple[int, ...] = ()  # one per tool call
    reward_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.response_tokens:
            raise ValueError(f"episode {self.episode_id}: response_tokens must have at least one turn")
        tool_calls = len(self.response_tokens) - 1
        if len(self.tool_latency_s) != tool_calls or len(self.tool_output_tokens) != tool_calls:
            raise ValueError(
                f"episode {self.episode_id}: {len(self.response_tokens)} turns need {tool_calls} tool "
                f"latencies and tool outputs, got {len(self.tool_latency_s)} and {len(self.tool_output_tokens)}"
            )
        if self.iteration < UNASSIGNED_ITERATION:
            raise ValueError(f"episode {self.episode_id}: iteration must be >= 0")
        if self.prompt_tokens < 1 or min(self.response_tokens) < 1:
            raise ValueError(f"episode {self.episode_id}: token counts must be positive")
        if any(t < 0 for t in self.tool_output_tokens):
            raise ValueError(f"episode {self.episode_id}: tool_output_tokens must be >= 0")
        if any(t < 0 for t in self.tool_latency_s) or self.reward_latency_s < 0:
            raise ValueError(f"episode {self.episode_id}: latencies must be >= 0")

    @property
    def turns(self) -> int:
        return len(self.response_tokens)

    @property
    def total_tokens(self) -> int:
        """The trained sequence: prompt, every response and every tool output."""
        return self.prompt_tokens + sum(self.response_tokens) + sum(self.tool_output_tokens)

    @property
    def generated_tokens(self) -> int:
        return sum(self.response_tokens)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "episode_id": self.episode_id,
            "prompt_id": self.prompt_id,
            "prompt_tokens": self.prompt_tokens,
            "response_tokens": list(self.response_tokens),
        }
        if self.iteration != UNASSIGNED_ITERATION:
            data["iteration"] = self.iteration
        if self.tool_latency_s:
            data["tool_latency_s"] = list(self.tool_latency_s)
            data["tool_output_tokens"] = list(self.tool_output_tokens)
        if self.reward_latency_s:
            data["reward_latency_s"] = self.reward_latency_s
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TraceRecord:
        return cls(
            episode_id=str(data["episode_id"]),
            prompt_id=str(data.get("prompt_id", data["episode_id"])),
            iteration=int(data.get("iteration", UNASSIGNED_ITERATION)),
            prompt_tokens=int(data["prompt_tokens"]),
            response_tokens=tuple(int(x) for x in data["response_tokens"]),
            tool_latency_s=tuple(float(x) for x in data.get("tool_latency_s", ())),
            tool_output_tokens=tuple(int(x) for x in data.get("tool_output_tokens", ())),
            reward_latency_s=float(data.get("reward_latency_s", 0.0)),
        )


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _clip(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


def generate_trace(workload: Workload, seed: int, *, iterations: int | None = None) -> list[TraceRecord]:
    """Draw ``iterations`` batches of the workload's episodes; same seed, same records."""
    rng = random.Random(f"{workload.name}:{seed}")
    count = workload.iterations if iterations is None else iterations
    records: list[TraceRecord] = []
    for iteration in range(count):
        for p in range(workload.prompts_per_iteration):
            prompt_id = f"i{iteration}-p{p}"
            prompt = int(
                _clip(
                    round(_lognormal(rng, workload.prompt_median, workload.prompt_sigma)),
                    workload.prompt_min,
                    workload.prompt_max,
                )
            )
            difficulty = rng.gauss(0.0, 1.0)
            for s in range(workload.samples_per_prompt):
                episode_id = f"{prompt_id}-s{s}"
                reward = _clip(
                    _lognormal(rng, workload.reward_latency_median_s, workload.reward_latency_sigma),
                    0.0,
                    30.0,
                )
                if workload.kind is WorkloadKind.MATH:
                    records.append(
                        _math_record(
                            rng, workload, episode_id, prompt_id, iteration, prompt, difficulty, reward
                        )
                    )
                else:
                    records.append(
                        _agentic_record(
                            rng, workload, episode_id, prompt_id, iteration, prompt, difficulty, reward
                        )
                    )
    return records


def _math_record(
    rng: random.Random,
    workload: Workload,
    episode_id: str,
    prompt_id: str,
    iteration: int,
    prompt: int,
    difficulty: float,
    reward: float,
) -> TraceRecord:
    lengths = workload.math
    median = lengths.median_fraction * workload.max_new_tokens
    log_length = (
        math.log(median) + lengths.sigma_prompt * difficulty + lengths.sigma_sample * rng.gauss(0.0, 1.0)
    )
    response = int(_clip(round(math.exp(log_length)), lengths.min_tokens, workload.max_new_tokens))
    return TraceRecord(
        episode_id=episode_id,
        prompt_id=prompt_id,
        iteration=iteration,
        prompt_tokens=prompt,
        response_tokens=(response,),
        reward_latency_s=round(reward, 6),
    )


def _agentic_record(
    rng: random.Random,
    workload: Workload,
    episode_id: str,
    prompt_id: str,
    iteration: int,
    prompt: int,
    difficulty: float,
    reward: float,
) -> TraceRecord:
    turns_model = workload.agentic
    # Geometric number of tool calls with the configured mean: stop after each turn w.p. 1/(mean+1).
    stop = 1.0 / (turns_model.mean_tool_calls + 1.0)
    responses: list[int] = []
    latencies: list[float] = []
    outputs: list[int] = []
    context = prompt
    for turn in range(turns_model.max_turns):
        median = turns_model.first_response_median * turns_model.response_decay**turn
        raw = _lognormal(rng, median, turns_model.response_sigma) * math.exp(0.4 * difficulty)
        room = turns_model.context_limit - context
        response = int(_clip(round(raw), turns_model.min_response_tokens, workload.max_new_tokens))
        last = turn == turns_model.max_turns - 1 or rng.random() < stop
        if response >= room:
            response = max(1, room)
            last = True
        responses.append(response)
        context += response
        if last:
            break
        output = int(
            _clip(
                round(_lognormal(rng, turns_model.tool_output_median, turns_model.tool_output_sigma)),
                1,
                turns_model.tool_output_max,
            )
        )
        latency = _clip(
            _lognormal(rng, turns_model.tool_latency_median_s, turns_model.tool_latency_sigma),
            0.0,
            turns_model.tool_latency_max_s,
        )
        if context + output + turns_model.min_response_tokens >= turns_model.context_limit:
            break
        outputs.append(output)
        latencies.append(round(latency, 6))
        context += output
    return TraceRecord(
        episode_id=episode_id,
        prompt_id=prompt_id,
        iteration=iteration,
        prompt_tokens=prompt,
        response_tokens=tuple(responses),
        tool_latency_s=tuple(latencies),
        tool_output_tokens=tuple(outputs),
        reward_latency_s=round(reward, 6),
    )


def decode_weighted_context(records: Sequence[TraceRecord]) -> float:
    """The context a decode step reads per sequence, averaged over every generated token.

    A long response holds its slot for many steps, so this is well above the mean context of a
    request: sum over turns of (r * context + r^2 / 2), over the tokens generated.
    """
    tokens = 0
    weighted = 0.0
    for record in records:
        context = record.prompt_tokens
        for turn, response in enumerate(record.response_tokens):
            tokens += response
            weighted += response * context + response * (response - 1) / 2.0
            context += response + (
                record.tool_output_tokens[turn] if turn < len(record.tool_output_tokens) else 0
            )
    return weighted / tokens if tokens else 0.0


def write_trace(path: str | Path, records: Iterable[TraceRecord], *, workload: str | None = None) -> None:
    """Write a header line and one JSON object per record."""
    header: dict[str, Any] = {"trace_format": TRACE_FORMAT, "version": TRACE_VERSION}
    if workload:
        header["workload"] = workload
    with Path(path).open("w", encoding="utf-8") as out:
        out.write(json.dumps(header, sort_keys=True) + "\n")
        for record in records:
            out.write(json.dumps(record.to_json(), sort_keys=True) + "\n")


@dataclass(frozen=True)
class Trace:
    records: tuple[TraceRecord, ...]
    workload: str | None = None


def read_trace_file(path: str | Path) -> Trace:
    """Read a trace and its header (the header is optional)."""
    workload: str | None = None
    records: list[TraceRecord] = []
    with Path(path).open(encoding="utf-8") as source:
        for number, line in enumerate(source, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}, line {number}: not JSON: {exc.msg}") from exc
            if not isinstance(data, dict):
                raise TraceFormatError(f"{path}, line {number}: expected a JSON object")
            if "trace_format" in data:
                if data["trace_format"] != TRACE_FORMAT or data.get("version") != TRACE_VERSION:
                    raise TraceFormatError(f"{path}, line {number}: unsupported trace header {data!r}")
                workload = data.get("workload")
                continue
            try:
                records.append(TraceRecord.from_json(data))
            except KeyError as exc:
                raise TraceFormatError(f"{path}, line {number}: missing field {exc.args[0]!r}") from exc
            except (TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}, line {number}: {exc}") from exc
    if not records:
        raise TraceFormatError(f"{path}: no records")
    return Trace(records=tuple(records), workload=workload)


def read_trace(path: str | Path) -> list[TraceRecord]:
    return list(read_trace_file(path).records)


def group_by_iteration(
    records: Sequence[TraceRecord], episodes_per_iteration: int
) -> list[list[TraceRecord]]:
    """Records of each iteration, in iteration order (iterations are renumbered densely).

    Records without an iteration follow the numbered ones, cut into batches of
    ``episodes_per_iteration`` in file order.
    """
    by_iteration: dict[int, list[TraceRecord]] = {}
    unassigned: list[TraceRecord] = []
    for record in records:
        if record.iteration == UNASSIGNED_ITERATION:
            unassigned.append(record)
        else:
            by_iteration.setdefault(record.iteration, []).append(record)
    batches = [by_iteration[i] for i in sorted(by_iteration)]
    size = max(1, episodes_per_iteration)
    batches.extend(unassigned[start : start + size] for start in range(0, len(unassigned), size))
    return batches
