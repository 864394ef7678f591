"""The ``runtime`` section of a job on the ray backend: defaults, values, and the rules across
sections the runtime relies on, each refused with the field at fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.spec import RuntimeModelSpec, RuntimeSpec, SpecError, parse_spec


def _ray_job(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "name": "real-math",
        "backend": "ray",
        "model": {"name": "tiny-gpt", "params_b": 0.0001},
        "workload": {
            "iterations": 4,
            "prompts_per_iteration": 8,
            "samples_per_prompt": 4,
            "max_new_tokens": 40,
        },
        "components": [
            {"name": "rollout", "kind": "rollout", "workers": 2},
            {"name": "reward", "kind": "reward", "workers": 1},
            {"name": "actor", "kind": "actor", "workers": 2, "depends_on": ["rollout", "reward"]},
        ],
        "policy": {"name": "static-disaggregated"},
    }
    document.update(changes)
    return document


def _errors(document: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(document)
    return {error.path: error.message for error in caught.value.errors}


def test_a_ray_job_without_a_runtime_section_runs_the_defaults() -> None:
    spec = parse_spec(_ray_job())
    assert spec.runtime == RuntimeSpec()
    assert spec.to_json()["runtime"]["model"]["hidden_size"] == RuntimeModelSpec().hidden_size


def test_the_runtime_section_is_read_and_stored() -> None:
    runtime = {
        "model": {
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "ffn_hidden_size": 64,
            "max_positions": 128,
        },
        "task": {"max_digits": 3, "zipf_exponent": 2.0},
        "dataset_size": 16,
        "seed": 5,
        "temperature": 0.8,
        "learning_rate": 0.002,
        "kl_coef": 0.0,
        "micro_batch_size": 4,
        "ppo_epochs": 3,
        "warm_start_steps": 30,
        "engine": "cpu",
        "routing": "priority",
    }
    spec = parse_spec(_ray_job(runtime=runtime))
    assert spec.runtime is not None
    assert spec.runtime.model == RuntimeModelSpec(32, 1, 2, 64, 128)
    assert (spec.runtime.max_digits, spec.runtime.seed, spec.runtime.warm_start_steps) == (3, 5, 30)
    assert spec.runtime.dataset_size == 16 and spec.runtime.engine == "cpu"
    assert spec.runtime.ppo_epochs == 3
    assert spec.to_json()["runtime"] == runtime


def test_a_sim_job_has_no_runtime() -> None:
    errors = _errors(_ray_job(backend="sim", runtime={"seed": 1}))
    assert errors["runtime"].startswith("only applies to jobs on the ray backend")
    assert parse_spec(_ray_job(backend="sim")).runtime is None


@pytest.mark.parametrize(
    ("runtime", "path", "start"),
    [
        (
            {"model": {"hidden_size": 30, "num_heads": 4}},
            "runtime.model.hidden_size",
            "must be a multiple of",
        ),
        ({"model": {"num_layers": 0}}, "runtime.model.num_layers", "must be at least 1"),
        ({"task": {"max_digits": 0}}, "runtime.task.max_digits", "must be at least 1"),
        ({"task": {"digits": 3}}, "runtime.task.digits", "unknown key"),
        ({"temperature": 0}, "runtime.temperature", "must be greater than 0"),
        ({"learning_rate": "fast"}, "runtime.learning_rate", "must be a number"),
        ({"micro_batch_size": 0}, "runtime.micro_batch_size", "must be at least 1"),
        ({"ppo_epochs": 0}, "runtime.ppo_epochs", "must be at least 1"),
        ({"ppo_epochs": 65}, "runtime.ppo_epochs", "must be at most 64"),
        ({"dataset_size": 0}, "runtime.dataset_size", "must be at least 1"),
        ({"optimizer": "sgd"}, "runtime.optimizer", "unknown key"),
        ({"engine": "vllm"}, "runtime.engine", "must be one of auto, sglang, cpu"),
        ({"kl_coef": 0.1}, "runtime.kl_coef", "a KL penalty needs an inference component"),
    ],
)
def test_bad_runtime_values_name_the_field(runtime: dict[str, Any], path: str, start: str) -> None:
    errors = _errors(_ray_job(runtime=runtime))
    assert path in errors, errors
    assert errors[path].lower().startswith(start.lower()) or start.lower() in errors[path].lower()


def test_the_runtime_rules_across_sections() -> None:
    document = _ray_job(
        workload={
            "kind": "math",
            "iterations": 2,
            "prompts_per_iteration": 3,
            "samples_per_prompt": 1,
            "max_new_tokens": 300,
            "staleness": 1,
        },
        components=[
            {"name": "rollout", "kind": "rollout", "workers": 1},
            {"name": "tools", "kind": "tool", "workers": 1},
            {"name": "actor", "kind": "actor", "workers": 2},
        ],
        runtime={"routing": "fifo"},
    )
    errors = _errors(document)
    assert errors["components[1].kind"].startswith("a tool component needs workload.kind agentic")
    assert errors["runtime.routing"].startswith("only applies when workload.kind is agentic")
    assert errors["components"].startswith("a job on the ray backend needs a reward component")
    assert errors["workload.staleness"].startswith("the ray runtime trains synchronously")
    assert "exceeds runtime.model.max_positions (64)" in errors["workload.max_new_tokens"]
    assert "does not over [2]" in errors["components[2]"]


def test_a_ray_trainers_valid_sizes_are_the_ones_its_global_batch_splits_over() -> None:
    # 8 prompts x 4 samples = 32: a trainer moved or re-placed to 3, 5, 6 or 7 ranks could not
    # keep the global batch fixed, so the spec states the sizes it can run.
    spec = parse_spec(_ray_job())
    actor = next(c for c in spec.components if c.kind.value == "actor")
    assert actor.valid_dp == (1, 2, 4, 8, 16, 32)
    capped = _ray_job(
        components=[
            {"name": "rollout", "kind": "rollout", "workers": 2},
            {"name": "reward", "kind": "reward", "workers": 1},
            {"name": "actor", "kind": "actor", "workers": 2, "min_workers": 2, "max_workers": 12},
        ]
    )
    actor = next(c for c in parse_spec(capped).components if c.kind.value == "actor")
    assert actor.valid_dp == (2, 4, 8)
    # Sizes the operator states are kept as stated.
    stated = _ray_job(
        components=[
            {"name": "rollout", "kind": "rollout", "workers": 2},
            {"name": "reward", "kind": "reward", "workers": 1},
            {"name": "actor", "kind": "actor", "workers": 2, "parallelism": {"valid_dp": [2, 4]}},
        ]
    )
    actor = next(c for c in parse_spec(stated).components if c.kind.value == "actor")
    assert actor.valid_dp == (2, 4)
    # A sim job's trainer has no batch to keep: any size between its limits.
    actor = next(c for c in parse_spec(_ray_job(backend="sim")).components if c.kind.value == "actor")
    assert actor.valid_dp == ()


AGENTIC_WORKLOAD = {
    "kind": "agentic",
    "iterations": 2,
    "prompts_per_iteration": 8,
    "samples_per_prompt": 4,
    "max_new_tokens": 40,
    "max_turns": 4,
    "tool_latency_s": 0.01,
}


def test_an_agentic_ray_job_needs_tool_workers_and_a_sane_number_of_turns() -> None:
    errors = _errors(_ray_job(workload={**AGENTIC_WORKLOAD, "max_turns": 1}))
    assert errors["components"].startswith("an agentic job on the ray backend needs a tool component")
    assert errors["workload.max_turns"].startswith("an agentic ray job's episode sums max_turns numbers")
    # The prompt holds max_turns numbers: 4 terms of 2 digits, the +s, BOS and the newline.
    long = _errors(_ray_job(workload={**AGENTIC_WORKLOAD, "max_new_tokens": 60}))
    assert (
        "the longest prompt (13 tokens at runtime.task.max_digits=2 and 4 terms)"
        in long["workload.max_new_tokens"]
    )


def test_the_agentic_ray_example_is_a_valid_spec() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "agentic-ray.yaml"
    spec = parse_spec(yaml.safe_load(example.read_text()))
    assert spec.backend == "ray" and spec.workload.kind == "agentic"
    assert spec.runtime is not None and spec.runtime.routing == "priority"
    assert {c.kind.value for c in spec.components} == {"rollout", "tool", "reward", "actor"}


def test_an_agentic_ray_job_with_tool_workers_is_accepted_with_its_routing() -> None:
    components = [*_ray_job()["components"], {"name": "tools", "kind": "tool", "workers": 1}]
    spec = parse_spec(_ray_job(workload=AGENTIC_WORKLOAD, components=components, runtime={"routing": "fifo"}))
    assert spec.runtime is not None and spec.runtime.routing == "fifo"
    assert spec.workload.max_turns == 4
    errors = _errors(_ray_job(workload=AGENTIC_WORKLOAD, components=components, runtime={"routing": "lifo"}))
    assert errors["runtime.routing"].startswith("must be one of priority, fifo")


def test_a_kl_penalty_with_an_inference_component_is_accepted() -> None:
    components = [*_ray_job()["components"], {"name": "reference", "kind": "inference", "workers": 1}]
    spec = parse_spec(_ray_job(components=components, runtime={"kl_coef": 0.05}))
    assert spec.runtime is not None and spec.runtime.kl_coef == 0.05
