"""dynarl's job-spec format: parsing, defaults, the stored form, and errors named by key path."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.spec import (
    SPEC_VERSION,
    ComponentSpec,
    FieldError,
    JobSpec,
    ModelSpec,
    PolicySpec,
    RankError,
    RuntimeModelSpec,
    RuntimeSpec,
    SpecError,
    WorkloadSpec,
    format_gpu_ranks,
    parse_gpu_ranks,
    parse_spec,
    parse_spec_file,
)
from jobs.spec import policy as spec_policy
from scheduler.core.hypergraph import ComponentKind, Parallelism
from scheduler.core.policies import POLICY_NAMES, build_policy

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.*"))


def _minimal() -> dict[str, Any]:
    return {
        "name": "job-1",
        "model": {"name": "qwen2.5-1.5b", "params_b": 1.5},
        "components": [
            {"name": "rollout", "kind": "rollout", "workers": 4},
            {"name": "actor", "kind": "actor", "workers": 2, "depends_on": ["rollout"]},
        ],
    }


def _errors(document: Any, **kwargs: Any) -> list[FieldError]:
    with pytest.raises(SpecError) as caught:
        parse_spec(document, **kwargs)
    return caught.value.errors


def _messages_at(errors: list[FieldError], path: str) -> list[str]:
    return [e.message for e in errors if e.path == path]


# -- good specs -----------------------------------------------------------------------------------


def test_examples_directory_has_the_documented_files() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "math-7b.yaml",
        "agentic-7b.yaml",
        "math-1.5b-colocated.json",
        "rlinf-disaggregated.yaml",
        "rlinf-colocated.yaml",
        "rlinf-hetero.yaml",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses_and_round_trips_through_json(path: Path) -> None:
    parsed = parse_spec_file(path)
    stored = json.loads(json.dumps(parsed.to_json()))
    assert JobSpec.from_json(stored) == parsed
    assert JobSpec.from_json(stored).to_json() == stored


def test_math_example_parses_to_the_expected_spec() -> None:
    expected = JobSpec(
        name="math-7b-grpo",
        priority=0,
        backend="sim",
        model=ModelSpec(name="qwen2.5-7b", params_b=7.0),
        workload=WorkloadSpec(
            kind="math",
            iterations=10,
            prompts_per_iteration=512,
            samples_per_prompt=8,
            max_new_tokens=8192,
            staleness=0,
        ),
        components=(
            ComponentSpec(name="rollout", kind=ComponentKind.ROLLOUT, workers=20, hardware=("H100",)),
            ComponentSpec(
                name="inference", kind=ComponentKind.INFERENCE, tp=2, workers=2, depends_on=("rollout",)
            ),
            ComponentSpec(
                name="actor",
                kind=ComponentKind.ACTOR,
                tp=2,
                pp=1,
                valid_dp=(2, 4, 8, 12, 16),
                workers=4,
                min_workers=2,
                max_workers=16,
                depends_on=("rollout", "inference"),
            ),
        ),
        policy=PolicySpec(name="dynarl", params={"u_low": 0.2}),
        tick_seconds=1.0,
        source_format="dynarl",
    )
    parsed = parse_spec_file(REPO / "examples" / "math-7b.yaml")
    assert parsed == expected
    assert parsed.total_gpus == 20 + 4 + 8


def test_agentic_example_expands_placements_and_keeps_agentic_fields() -> None:
    parsed = parse_spec_file(REPO / "examples" / "agentic-7b.yaml")
    assert parsed.workload.kind == "agentic"
    assert (parsed.workload.max_turns, parsed.workload.tool_latency_s, parsed.workload.staleness) == (
        12,
        2.5,
        1,
    )
    rollout = parsed.component("rollout")
    assert rollout.placement == tuple(range(16))
    assert rollout.workers is None
    assert (rollout.worker_count, rollout.gpus_per_worker, rollout.gpus) == (8, 2, 16)
    assert rollout.hardware == ("H20", "H100")
    actor = parsed.component("actor")
    assert actor.placement == tuple(range(16, 24))
    assert actor.worker_count == 2
    assert actor.parallelism == Parallelism(tp=4, pp=1, valid_dp=(1, 2, 4))
    assert [c.name for c in parsed.components_of(ComponentKind.TOOL)] == ["tools"]
    assert parsed.total_gpus == 28


def test_the_same_spec_as_yaml_text_json_text_and_a_mapping_is_the_same_job() -> None:
    document = yaml.safe_load((REPO / "examples" / "math-7b.yaml").read_text())
    from_yaml = parse_spec((REPO / "examples" / "math-7b.yaml").read_text())
    from_json = parse_spec(json.dumps(document, indent=2))
    from_mapping = parse_spec(document)
    assert from_yaml == from_json == from_mapping


def test_defaults_fill_everything_not_written() -> None:
    parsed = parse_spec(_minimal())
    assert (parsed.priority, parsed.backend, parsed.tick_seconds, parsed.source_format) == (
        0,
        "sim",
        1.0,
        "dynarl",
    )
    assert parsed.workload == WorkloadSpec()
    assert parsed.workload.max_turns is None and parsed.workload.tool_latency_s is None
    assert parsed.policy == PolicySpec(name="dynarl", params={})
    rollout = parsed.component("rollout")
    assert (rollout.tp, rollout.pp, rollout.valid_dp, rollout.min_workers, rollout.max_workers) == (
        1,
        1,
        (),
        1,
        None,
    )
    assert (rollout.hardware, rollout.depends_on, rollout.colocated_with, rollout.placement) == (
        (),
        (),
        (),
        None,
    )


def test_agentic_defaults_are_filled_for_agentic_workloads_only() -> None:
    document = _minimal()
    document["workload"] = {"kind": "agentic"}
    parsed = parse_spec(document)
    assert (parsed.workload.max_turns, parsed.workload.tool_latency_s) == (8, 1.0)


def test_valid_dp_is_stored_sorted() -> None:
    document = _minimal()
    document["components"][1]["parallelism"] = {"valid_dp": [8, 2, 4]}
    assert parse_spec(document).component("actor").valid_dp == (2, 4, 8)


def test_colocation_is_accepted_under_static_colocated() -> None:
    parsed = parse_spec_file(REPO / "examples" / "math-1.5b-colocated.json")
    assert parsed.policy.name == "static-colocated"
    assert {c.placement for c in parsed.components} == {tuple(range(8))}
    assert parsed.total_gpus == 8  # shared GPUs count once


def test_colocation_under_another_policy_needs_colocated_with() -> None:
    document = json.loads((REPO / "examples" / "math-1.5b-colocated.json").read_text())
    document["policy"] = {"name": "dynarl"}
    errors = _errors(document)
    assert [e.path for e in errors] == [
        "components[1].placement",
        "components[2].placement",
        "components[2].placement",
    ]
    assert "shares GPUs 0-7 with component 'rollout'" in errors[0].message

    document["components"][1]["colocated_with"] = ["rollout", "actor"]
    document["components"][2]["colocated_with"] = ["rollout"]
    parsed = parse_spec(document)
    assert parsed.component("reward").colocated_with == ("rollout", "actor")


def test_partial_overlap_marked_colocated_is_accepted_and_total_counts_shared_gpus_once() -> None:
    document = _minimal()
    document["components"] = [
        {"name": "rollout", "kind": "rollout", "placement": "0-5"},
        {"name": "reward", "kind": "reward", "placement": "4-7", "colocated_with": ["rollout"]},
        {"name": "actor", "kind": "actor", "workers": 2, "parallelism": {"tp": 2}},
    ]
    parsed = parse_spec(document, cluster_gpus=16)
    assert parsed.total_gpus == 8 + 4


def test_all_placement_expands_to_the_cluster() -> None:
    document = _minimal()
    document["policy"] = {"name": "static-colocated"}
    document["components"][0] = {"name": "rollout", "kind": "rollout", "placement": "all"}
    document["components"][1] = {
        "name": "actor",
        "kind": "actor",
        "placement": "all",
        "parallelism": {"tp": 4},
    }
    parsed = parse_spec(document, cluster_gpus=16)
    assert parsed.component("rollout").placement == tuple(range(16))
    assert parsed.component("actor").worker_count == 4


def test_policy_from_the_registry_with_its_params_is_accepted_as_written() -> None:
    document = _minimal()
    document["policy"] = {
        "name": "rlinf-auto",
        "params": {"use_pre_process_policy": False, "n_minibatches": 8},
    }
    parsed = parse_spec(document)
    assert parsed.policy == PolicySpec(
        name="rlinf-auto", params={"use_pre_process_policy": False, "n_minibatches": 8}
    )


# -- the stored form ------------------------------------------------------------------------------


def _every_field_set() -> JobSpec:
    return JobSpec(
        name="full",
        priority=-7,
        backend="ray",
        model=ModelSpec(name="m", params_b=32.0),
        workload=WorkloadSpec(
            kind="agentic",
            iterations=3,
            prompts_per_iteration=64,
            samples_per_prompt=4,
            max_new_tokens=1024,
            staleness=2,
            trace="traces/agentic.jsonl",
            max_turns=5,
            tool_latency_s=0.25,
        ),
        components=(
            ComponentSpec(
                name="rollout",
                kind=ComponentKind.ROLLOUT,
                tp=2,
                pp=2,
                valid_dp=(1, 2),
                placement=(0, 1, 2, 3, 6, 7, 8, 9),
                min_workers=0,
                max_workers=4,
                hardware=("H20",),
                colocated_with=("reward",),
            ),
            ComponentSpec(
                name="reward",
                kind=ComponentKind.REWARD,
                placement=(6, 7),
                depends_on=("rollout",),
                colocated_with=("rollout",),
            ),
            ComponentSpec(
                name="actor", kind=ComponentKind.ACTOR, workers=3, depends_on=("rollout", "reward")
            ),
        ),
        policy=PolicySpec(name="bidirectional", params={"a": 1, "b": 0.5, "c": True}),
        tick_seconds=0.25,
        source_format="rlinf",
        runtime=RuntimeSpec(
            model=RuntimeModelSpec(
                hidden_size=48, num_layers=3, num_heads=6, ffn_hidden_size=96, max_positions=512
            ),
            max_digits=7,
            zipf_exponent=0.8,
            dataset_size=100,
            seed=11,
            temperature=0.7,
            learning_rate=3e-4,
            kl_coef=0.05,
            micro_batch_size=4,
            warm_start_steps=50,
        ),
    )


def test_to_json_is_plain_json_and_round_trips_exactly() -> None:
    original = _every_field_set()
    stored = original.to_json()
    assert stored["spec_version"] == SPEC_VERSION
    assert json.loads(json.dumps(stored)) == stored
    loaded = JobSpec.from_json(json.loads(json.dumps(stored)))
    assert loaded == original
    assert loaded.to_json() == stored
    assert isinstance(loaded.components[0].placement, tuple)


def test_from_json_refuses_another_spec_version() -> None:
    stored = _every_field_set().to_json()
    stored["spec_version"] = SPEC_VERSION + 1
    with pytest.raises(SpecError) as caught:
        JobSpec.from_json(stored)
    assert caught.value.paths == ["spec_version"]


def test_component_counts_and_gpus() -> None:
    spec = _every_field_set()
    rollout, reward, actor = spec.components
    assert (rollout.gpus_per_worker, rollout.worker_count, rollout.gpus) == (4, 2, 8)
    assert (reward.worker_count, reward.gpus) == (2, 2)
    assert (actor.worker_count, actor.gpus) == (3, 3)
    assert spec.total_gpus == len({0, 1, 2, 3, 6, 7, 8, 9}) + 3
    with pytest.raises(KeyError):
        spec.component("critic")


# -- bad specs: one problem each, named by path ---------------------------------------------------


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(document: dict[str, Any]) -> None:
        node: Any = document
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(document: dict[str, Any]) -> None:
        node: Any = document
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return mutate


BAD_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("missing name", _delete(("name",)), "name", "is required"),
    ("name with a space", _set(("name",), "my job"), "name", "1-100 characters"),
    ("name too long", _set(("name",), "x" * 101), "name", "1-100 characters"),
    ("priority is a boolean", _set(("priority",), True), "priority", "must be an integer, got a boolean"),
    ("backend unknown", _set(("backend",), "k8s"), "backend", "must be one of sim, ray"),
    ("unknown top-level key", _set(("prority",), 1), "prority", "did you mean 'priority'"),
    ("model missing", _delete(("model",)), "model", "is required"),
    ("model not a mapping", _set(("model",), "qwen"), "model", "must be a mapping"),
    ("params_b a string", _set(("model", "params_b"), "7B"), "model.params_b", "must be a number"),
    ("params_b zero", _set(("model", "params_b"), 0), "model.params_b", "greater than 0"),
    ("unknown model key", _set(("model", "size"), 7), "model.size", "unknown key"),
    ("iterations zero", _set(("workload",), {"iterations": 0}), "workload.iterations", "at least 1"),
    ("workload kind", _set(("workload",), {"kind": "chat"}), "workload.kind", "must be one of math, agentic"),
    ("max_turns on math", _set(("workload",), {"max_turns": 4}), "workload.max_turns", "only applies"),
    ("staleness negative", _set(("workload",), {"staleness": -1}), "workload.staleness", "at least 0"),
    ("trace empty", _set(("workload",), {"trace": ""}), "workload.trace", "must not be empty"),
    ("tick zero", _set(("tick_seconds",), 0), "tick_seconds", "greater than 0"),
    ("tick huge", _set(("tick_seconds",), 7200), "tick_seconds", "at most 3600"),
    ("components empty", _set(("components",), []), "components", "at least one component"),
    ("component not a mapping", _set(("components", 0), "rollout"), "components[0]", "must be a mapping"),
    ("component kind", _set(("components", 0, "kind"), "trainer"), "components[0].kind", "must be one of"),
    ("component name", _set(("components", 0, "name"), "1st"), "components[0].name", "start with a letter"),
    (
        "tp a string",
        _set(("components", 1, "parallelism"), {"tp": "2"}),
        "components[1].parallelism.tp",
        "integer",
    ),
    (
        "tp zero",
        _set(("components", 1, "parallelism"), {"tp": 0}),
        "components[1].parallelism.tp",
        "at least 1",
    ),
    (
        "pp a float",
        _set(("components", 1, "parallelism"), {"pp": 2.0}),
        "components[1].parallelism.pp",
        "integer",
    ),
    (
        "valid_dp repeated",
        _set(("components", 1, "parallelism"), {"valid_dp": [2, 2]}),
        "components[1].parallelism.valid_dp[1]",
        "listed twice",
    ),
    (
        "parallelism unknown key",
        _set(("components", 1, "parallelism"), {"dp": 2}),
        "components[1].parallelism.dp",
        "unknown key",
    ),
    (
        "workers a float",
        _set(("components", 0, "workers"), 4.0),
        "components[0].workers",
        "must be an integer",
    ),
    ("workers zero", _set(("components", 0, "workers"), 0), "components[0].workers", "at least 1"),
    (
        "workers and placement",
        _set(("components", 0, "placement"), "0-3"),
        "components[0]",
        "mutually exclusive",
    ),
    ("no workers or placement", _delete(("components", 0, "workers")), "components[0]", "needs workers"),
    (
        "hardware entry empty",
        _set(("components", 0, "hardware"), ["H100", ""]),
        "components[0].hardware[1]",
        "non-empty",
    ),
    (
        "hardware not a list",
        _set(("components", 0, "hardware"), "H100"),
        "components[0].hardware",
        "must be a list",
    ),
    (
        "depends_on unknown",
        _set(("components", 1, "depends_on"), ["rolout"]),
        "components[1].depends_on[0]",
        "did you mean",
    ),
    (
        "depends_on itself",
        _set(("components", 1, "depends_on"), ["actor"]),
        "components[1].depends_on[0]",
        "itself",
    ),
    (
        "min above max",
        _set(("components", 0, "max_workers"), 2),
        "components[0].workers",
        "above max_workers (2)",
    ),
    (
        "workers below min",
        _set(("components", 0, "min_workers"), 5),
        "components[0].workers",
        "below min_workers (5)",
    ),
    ("negative min", _set(("components", 0, "min_workers"), -1), "components[0].min_workers", "at least 0"),
    ("policy unknown", _set(("policy",), {"name": "dynrl"}), "policy.name", "did you mean 'dynarl'"),
    ("policy unknown key", _set(("policy",), {"name": "dynarl", "args": {}}), "policy.args", "unknown key"),
    ("policy params not a mapping", _set(("policy",), {"params": [1]}), "policy.params", "must be a mapping"),
    (
        "policy param out of range",
        _set(("policy",), {"name": "dynarl", "params": {"u_low": 1.5}}),
        "policy.params.u_low",
        "<= 1.0",
    ),
    (
        "policy param unknown",
        _set(("policy",), {"name": "dynarl", "params": {"u_high": 0.5}}),
        "policy.params.u_high",
        "unknown parameter",
    ),
    (
        "policy param wrong type",
        _set(("policy",), {"name": "rlinf-auto", "params": {"use_pre_process_policy": 1}}),
        "policy.params.use_pre_process_policy",
        "true or false",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_a_bad_field_is_reported_at_its_path(
    mutate: Callable[[dict[str, Any]], None], path: str, fragment: str
) -> None:
    document = _minimal()
    mutate(document)
    errors = _errors(document)
    assert any(fragment in message for message in _messages_at(errors, path)), errors


def test_worker_count_outside_valid_dp() -> None:
    document = _minimal()
    document["components"][1]["parallelism"] = {"valid_dp": [4, 8]}
    errors = _errors(document)
    assert _messages_at(errors, "components[1].workers") == [
        "2 workers is not one of parallelism.valid_dp (4, 8)"
    ]


def test_max_workers_below_min_workers() -> None:
    document = _minimal()
    document["components"][0].update(min_workers=4, max_workers=2)
    errors = _errors(document)
    assert [e.path for e in errors] == ["components[0].max_workers"]


def test_duplicate_component_names() -> None:
    document = _minimal()
    document["components"].append({"name": "rollout", "kind": "reward", "workers": 1})
    errors = _errors(document)
    assert _messages_at(errors, "components[2].name") == [
        "duplicate component name 'rollout' (first used at components[0].name)"
    ]


def test_exactly_one_actor_and_at_least_one_rollout() -> None:
    document = _minimal()
    document["components"][0]["kind"] = "actor"
    errors = _errors(document)
    assert _messages_at(errors, "components") == [
        "needs exactly one actor component, found 2 ('rollout', 'actor')",
        "needs at least one rollout component",
    ]
    document["components"] = [{"name": "rollout", "kind": "rollout", "workers": 1}]
    assert _messages_at(_errors(document), "components") == ["needs exactly one actor component, found 0"]


def test_dependency_cycle_is_reported_once() -> None:
    document = _minimal()
    document["components"][0]["depends_on"] = ["actor"]
    document["components"].append(
        {"name": "reward", "kind": "reward", "workers": 1, "depends_on": ["reward2"]}
    )
    document["components"].append(
        {"name": "reward2", "kind": "reward", "workers": 1, "depends_on": ["reward"]}
    )
    errors = _errors(document)
    assert [(e.path, e.message) for e in errors] == [
        ("components[0].depends_on", "dependency cycle: rollout -> actor -> rollout"),
        ("components[2].depends_on", "dependency cycle: reward -> reward2 -> reward"),
    ]


@pytest.mark.parametrize(
    ("placement", "tp", "cluster_gpus", "fragment"),
    [
        ("5-3", 1, None, "range 5-3 is reversed"),
        ("0-9", 1, 8, "range 0-9 exceeds the cluster's 8 GPUs (ranks 0-7)"),
        ("12", 1, 8, "rank 12 exceeds the cluster's 8 GPUs"),
        ("0-3,2-5", 1, None, "rank 2 is listed twice"),
        ("0-3;4", 1, None, "is not a rank or a range"),
        ("all", 1, None, '"all" needs the cluster size'),
        ("0-2", 2, None, "3 GPUs (0-2) are not a whole number of workers of tp x pp = 2 GPUs"),
        ("", 1, None, "is empty"),
    ],
)
def test_bad_placements(placement: str, tp: int, cluster_gpus: int | None, fragment: str) -> None:
    document = _minimal()
    document["components"][0] = {
        "name": "rollout",
        "kind": "rollout",
        "placement": placement,
        "parallelism": {"tp": tp},
    }
    errors = _errors(document, cluster_gpus=cluster_gpus)
    assert any(fragment in m for m in _messages_at(errors, "components[0].placement")), errors


def test_placement_of_the_wrong_type() -> None:
    document = _minimal()
    document["components"][0] = {"name": "rollout", "kind": "rollout", "placement": [0, 1]}
    assert "must be a rank list" in _messages_at(_errors(document), "components[0].placement")[0]


def test_job_larger_than_the_cluster() -> None:
    document = _minimal()
    document["components"][0]["workers"] = 10
    errors = _errors(document, cluster_gpus=8)
    assert _messages_at(errors, "components") == ["the job needs 12 GPUs at start; the cluster has 8"]


@pytest.mark.parametrize(
    ("components", "path", "fragment"),
    [
        (
            [
                {"name": "rollout", "kind": "rollout", "placement": "0-3", "colocated_with": ["actor"]},
                {"name": "actor", "kind": "actor", "workers": 2},
            ],
            "components[0].colocated_with[0]",
            "has a worker count, not an explicit placement",
        ),
        (
            [
                {"name": "rollout", "kind": "rollout", "workers": 4, "colocated_with": ["actor"]},
                {"name": "actor", "kind": "actor", "placement": "0-1"},
            ],
            "components[0].colocated_with",
            "needs an explicit placement",
        ),
        (
            [
                {"name": "rollout", "kind": "rollout", "placement": "0-3", "colocated_with": ["actor"]},
                {"name": "actor", "kind": "actor", "placement": "4-5"},
            ],
            "components[0].colocated_with[0]",
            "shares no GPU with component 'actor'",
        ),
        (
            [
                {"name": "rollout", "kind": "rollout", "placement": "0-3", "colocated_with": ["critic"]},
                {"name": "actor", "kind": "actor", "placement": "4-5"},
            ],
            "components[0].colocated_with[0]",
            "unknown component 'critic'",
        ),
        (
            [
                {"name": "rollout", "kind": "rollout", "placement": "0-3", "colocated_with": ["rollout"]},
                {"name": "actor", "kind": "actor", "placement": "4-5"},
            ],
            "components[0].colocated_with[0]",
            "itself",
        ),
    ],
)
def test_bad_colocation_marks(components: list[dict[str, Any]], path: str, fragment: str) -> None:
    document = _minimal()
    document["components"] = components
    errors = _errors(document)
    assert any(fragment in m for m in _messages_at(errors, path)), errors


def test_many_problems_are_reported_together() -> None:
    document = _minimal()
    document["name"] = "bad name"
    document["backend"] = "gpu"
    document["workload"] = {"iterations": "ten"}
    document["components"][0]["parallelism"] = {"tp": True}
    document["components"][1]["depends_on"] = ["nope"]
    document["components"][1]["hardware"] = [7]
    document["policy"] = {"name": "dynarl", "params": {"u_low": 2.0, "max_candidates": 0}}
    document["extra"] = True
    errors = _errors(document)
    assert sorted(e.path for e in errors) == sorted(
        [
            "extra",
            "name",
            "backend",
            "workload.iterations",
            "components[0].parallelism.tp",
            "components[1].hardware[0]",
            "components[1].depends_on[0]",
            "policy.params.u_low",
            "policy.params.max_candidates",
        ]
    )
    text = str(SpecError(errors))
    assert "9 problems" in text
    assert "components[1].depends_on[0]: unknown component 'nope'" in text


def test_spec_error_to_json_lists_every_problem() -> None:
    document = _minimal()
    document["priority"] = "high"
    document["tick_seconds"] = -1
    with pytest.raises(SpecError) as caught:
        parse_spec(document)
    assert caught.value.to_json() == [
        {"path": "priority", "message": "must be an integer, got a string ('high')"},
        {"path": "tick_seconds", "message": "must be greater than 0, got -1"},
    ]
    assert isinstance(caught.value, ValueError)


# -- documents that are not specs -----------------------------------------------------------------


def test_yaml_syntax_error_names_line_and_column() -> None:
    errors = _errors("name: job\nmodel: {name: m, params_b: 7\ncomponents: []\n")
    assert len(errors) == 1
    assert errors[0].path == ""
    assert errors[0].message.startswith("YAML syntax error at line 3, column")


def test_json_syntax_error_names_line_and_column() -> None:
    errors = _errors('{"name": "job",\n "model": }')
    assert [(e.path, e.message) for e in errors] == [
        ("", "JSON syntax error at line 2, column 11: Expecting value")
    ]


def test_a_one_line_yaml_flow_mapping_is_yaml_not_bad_json() -> None:
    text = "{name: job-1, model: {name: m, params_b: 1}, components: [{name: r, kind: rollout, workers: 1}, {name: a, kind: actor, workers: 1}]}"
    assert parse_spec(text).name == "job-1"


def test_keys_written_twice_are_refused_in_yaml_and_json() -> None:
    yaml_errors = _errors("name: a\npriority: 1\nname: b\n")
    assert yaml_errors[0].path == ""
    assert "duplicate key 'name'" in yaml_errors[0].message
    assert "line 3" in yaml_errors[0].message
    json_errors = _errors('{"name": "a", "name": "b"}')
    assert json_errors[0].message == "JSON object has a duplicate key 'name'"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "the document is empty"),
        ("# only a comment\n", "the document is empty"),
        ("- name: a\n", "must be a mapping at the top level, got a list"),
        ("just a string", "must be a mapping at the top level, got a string"),
    ],
)
def test_documents_that_are_not_mappings(text: str, fragment: str) -> None:
    errors = _errors(text)
    assert [e.path for e in errors] == [""]
    assert fragment in errors[0].message


def test_yaml_tags_that_build_objects_are_refused() -> None:
    errors = _errors("name: !!python/object/apply:os.system ['true']\n")
    assert errors[0].path == ""
    assert "YAML syntax error" in errors[0].message


def test_non_string_keys_are_named() -> None:
    document = _minimal()
    document[4090] = "x"  # type: ignore[index]
    errors = _errors(document)
    assert _messages_at(errors, "") == ["keys must be strings, got an integer (4090)"]


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec_file(tmp_path / "missing.yaml")
    assert caught.value.paths == [""]
    assert "cannot read" in caught.value.errors[0].message


def test_spec_file_in_json(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_minimal()))
    assert parse_spec_file(path) == parse_spec(_minimal())


def test_cluster_gpus_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="cluster_gpus"):
        parse_spec(_minimal(), cluster_gpus=0)


# -- rank lists -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "limit", "expected"),
    [
        ("0-3", None, (0, 1, 2, 3)),
        ("0-1,4-5", 8, (0, 1, 4, 5)),
        ("0-3,5,14", 16, (0, 1, 2, 3, 5, 14)),
        (" 6 , 2-3 ", 8, (2, 3, 6)),
        (3, 4, (3,)),
        ("all", 4, (0, 1, 2, 3)),
    ],
)
def test_parse_gpu_ranks(value: object, limit: int | None, expected: tuple[int, ...]) -> None:
    assert parse_gpu_ranks(value, limit) == expected


@pytest.mark.parametrize(
    ("value", "limit"), [("3-1", None), ("0-8", 8), ("1,1", None), ("a-b", None), (True, 8), (1.5, 8)]
)
def test_parse_gpu_ranks_refuses(value: object, limit: int | None) -> None:
    with pytest.raises(RankError):
        parse_gpu_ranks(value, limit)


def test_capacity_wording_in_rank_errors() -> None:
    with pytest.raises(RankError, match=r"range 2-4 exceeds the 4 GPUs of group x \(ranks 0-3\)"):
        parse_gpu_ranks("2-4", 4, capacity="the 4 GPUs of group x")


def test_format_gpu_ranks() -> None:
    assert format_gpu_ranks([6, 0, 1, 2, 3, 9, 10]) == "0-3,6,9-10"
    assert format_gpu_ranks([]) == ""


# -- the policy registry ---------------------------------------------------------------------------


class _FakeParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def test_policy_errors_are_mapped_by_the_param_the_registry_names(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def build(name: str, **kwargs: Any) -> object:
        calls.append(kwargs["params"])
        if kwargs["params"].get("depth", 0) > 3:
            raise _FakeParamError("depth", "depth too big")
        if kwargs["params"].get("depth") == 2 and kwargs["params"].get("width") == 2:
            raise _FakeParamError("other", "depth and width cannot both be 2")
        return object()

    registry = spec_policy.PolicyRegistry(names=("custom",), build=build)
    monkeypatch.setattr(spec_policy, "policy_registry", lambda: registry)
    document = _minimal()
    document["policy"] = {"name": "custom", "params": {"depth": 5}}
    assert [(e.path, e.message) for e in _errors(document)] == [("policy.params.depth", "depth too big")]

    # A constraint between parameters, named by a key the spec does not have, lands on params.
    document["policy"]["params"] = {"depth": 2, "width": 2}
    assert [e.path for e in _errors(document)] == ["policy.params"]
    assert {"depth": 2, "width": 2} in calls

    document["policy"]["name"] = "dynarl"
    assert _messages_at(_errors(document), "policy.name") == ["unknown policy 'dynarl' (known: custom)"]


def test_without_a_registry_names_are_known_and_params_only_type_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = spec_policy.PolicyRegistry(names=POLICY_NAMES, build=None)
    monkeypatch.setattr(spec_policy, "policy_registry", lambda: registry)
    document = _minimal()
    document["policy"] = {"name": "bidirectional", "params": {"anything": 3, "flag": True}}
    assert parse_spec(document).policy.params == {"anything": 3, "flag": True}
    document["policy"]["params"] = {"bad": "text"}
    assert _messages_at(_errors(document), "policy.params.bad") == [
        "must be a number or true/false, got a string ('text')"
    ]


def test_the_real_registry_is_used() -> None:
    registry = spec_policy.policy_registry()
    assert registry.build is build_policy
    assert registry.names == POLICY_NAMES


def test_spec_module_does_not_import_django() -> None:
    code = (
        "import sys; import jobs.spec, jobs.spec.rlinf; "
        "jobs.spec.parse_spec_file('examples/rlinf-disaggregated.yaml'); "
        "bad = sorted(m for m in sys.modules if m == 'django' or m.startswith('django.')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_parse_does_not_modify_the_given_mapping() -> None:
    document = _minimal()
    before = copy.deepcopy(document)
    parse_spec(document)
    assert document == before
