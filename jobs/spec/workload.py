"""The workload (the data and batch shape of one RL iteration), read the same way for both formats,
and trace file paths."""

from __future__ import annotations

import re
from typing import Final

from jobs.spec.model import WorkloadSpec
from jobs.spec.sections import Section
from jobs.spec.values import shown

AGENTIC_ONLY_KEYS: Final = ("max_turns", "tool_latency_s")
DEFAULT_MAX_TURNS: Final = 8
DEFAULT_TOOL_LATENCY_S: Final = 1.0


def trace_path_problem(path: str) -> str | None:
    """What is wrong with ``workload.trace`` as far as the control plane can tell, or None.

    A trace names a file under the trace directory of the agents that run the job (their
    ``--trace-dir``): a relative path that never climbs out of it. Each agent checks again where
    the path really leads (symbolic links included) before it opens anything."""
    if "\x00" in path:
        return "must not contain a NUL byte"
    if path.startswith(("/", "\\")):
        return (
            f"must be a path relative to the agents' trace directory (--trace-dir), not an absolute path; "
            f"got {shown(path)}"
        )
    if ".." in re.split(r"[/\\]", path):
        return f"must not climb out of the agents' trace directory with '..'; got {shown(path)}"
    return None


def check_trace(section: Section, trace: str | None, key: str = "trace") -> str | None:
    """``trace`` when it may name a trace file, else None with the problem reported at ``key``."""
    if trace is None:
        return None
    problem = trace_path_problem(trace)
    if problem is not None:
        section.fail(key, problem)
        return None
    return trace


def read_workload(
    section: Section,
    *,
    kind: str | None,
    iterations: int | None,
    prompts_per_iteration: int | None,
    samples_per_prompt: int | None,
    max_new_tokens: int | None,
    not_agentic: str,
) -> WorkloadSpec | None:
    """The workload, from its kind and batch shape (each format reads those from its own keys, and
    passes ``None`` for one already reported) and from the keys both formats write alike in
    ``section``: ``staleness``, ``trace``, and for agentic workloads ``max_turns`` and
    ``tool_latency_s``. An agentic key on another kind is reported with ``not_agentic``, formatted
    with ``kind``. None when anything is bad; every problem is reported."""
    staleness = section.integer("staleness", 0, minimum=0)
    trace = check_trace(section, section.string("trace", None, nullable=True, max_length=500))
    trace_ok = not section.has("trace") or section.peek("trace") is None or trace is not None
    max_turns: int | None = None
    tool_latency_s: float | None = None
    agentic_ok = True
    if kind == "agentic":
        max_turns = section.integer("max_turns", DEFAULT_MAX_TURNS, minimum=1)
        tool_latency_s = section.number("tool_latency_s", DEFAULT_TOOL_LATENCY_S, minimum=0.0)
        agentic_ok = max_turns is not None and tool_latency_s is not None
    elif kind is not None:
        for key in AGENTIC_ONLY_KEYS:
            if section.has(key):
                section.fail(key, not_agentic.format(kind=kind))
    values = (kind, iterations, prompts_per_iteration, samples_per_prompt, max_new_tokens, staleness)
    if any(v is None for v in values) or not trace_ok or not agentic_ok:
        return None
    assert kind is not None and iterations is not None
    assert prompts_per_iteration is not None and samples_per_prompt is not None
    assert max_new_tokens is not None and staleness is not None
    return WorkloadSpec(
        kind=kind,
        iterations=iterations,
        prompts_per_iteration=prompts_per_iteration,
        samples_per_prompt=samples_per_prompt,
        max_new_tokens=max_new_tokens,
        staleness=staleness,
        trace=trace,
        max_turns=max_turns,
        tool_latency_s=tool_latency_s,
    )
