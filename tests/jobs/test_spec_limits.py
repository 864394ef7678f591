"""Bounds on a spec document, checked while it is read and before any other work: size, nesting,
values (YAML aliases counted as expanded), alias uses, rank ranges, integer ranges, trace paths,
and messages that stay short whatever the document holds."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.spec import (
    DEFAULT_LIMITS,
    INTEGER_MAX,
    MAX_GPU_RANKS,
    MAX_MESSAGE_CHARS,
    MAX_PATH_CHARS,
    MAX_REPORTED_PROBLEMS,
    DocumentLimits,
    FieldError,
    RankError,
    SpecError,
    check_document_bounds,
    load_document,
    parse_gpu_ranks,
    parse_spec,
)
from tests.jobs.test_spec import _errors, _minimal
from tests.services import memory_ceiling

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3

SPEC_YAML = """\
name: job-1
model: {name: qwen2.5-1.5b, params_b: 1.5}
components:
  - {name: rollout, kind: rollout, workers: 4}
  - {name: actor, kind: actor, workers: 2, depends_on: [rollout]}
"""


def _only(errors: list[FieldError]) -> FieldError:
    assert len(errors) == 1, errors
    return errors[0]


def alias_chain(levels: int = 9, width: int = 10) -> str:
    """The ~600-byte YAML of the report: ``a0`` lists ``width`` scalars, each next level lists
    ``width`` aliases of the one before, so ``a8`` stands for 10**9 values."""
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


# -- the alias chain (finding 2) --------------------------------------------------------------------


def test_an_alias_chain_in_a_policy_parameter_is_refused_with_a_short_message() -> None:
    text = alias_chain() + SPEC_YAML + "policy:\n  name: dynarl\n  params:\n    u_low: *a8\n"
    assert len(text) < 1000
    # Before the bound, the type error's repr() of the expanded value grew without end: the
    # ceiling turns that into a MemoryError here instead of exhausting the machine.
    with memory_ceiling(GIB):
        error = _only(_errors(text))
    assert error.path == ""
    assert f"more than {DEFAULT_LIMITS.max_nodes} values" in error.message
    assert "aliases" in error.message and "(at line 5," in error.message  # where a4 goes past the limit
    assert len(str(error)) < 300


def test_an_alias_chain_in_an_rlinf_configs_policy_params_is_refused() -> None:
    text = (
        alias_chain()
        + (REPO / "examples" / "rlinf-disaggregated.yaml").read_text()
        + "\ndynarl:\n  policy: dynarl\n  policy_params:\n    u_low: *a8\n"
    )
    with memory_ceiling(GIB):
        error = _only(_errors(text))
    assert error.path == "" and f"more than {DEFAULT_LIMITS.max_nodes} values" in error.message


def test_anchors_and_aliases_within_the_limits_are_read_as_yaml_defines_them() -> None:
    text = """\
name: shared
model: {name: qwen2.5-1.5b, params_b: 1.5}
components:
  - &engine {name: rollout, kind: rollout, workers: 4, hardware: &gpus [H100, A100]}
  - {name: actor, kind: actor, workers: 2, depends_on: [rollout], hardware: *gpus}
"""
    spec = parse_spec(text)
    assert spec.component("actor").hardware == spec.component("rollout").hardware == ("H100", "A100")


def test_alias_uses_are_capped() -> None:
    uses = DEFAULT_LIMITS.max_aliases + 1
    text = SPEC_YAML + f"x-one: &one 1\nx-many: [{', '.join(['*one'] * uses)}]\n"
    error = _only(_errors(text))
    assert f"more than {DEFAULT_LIMITS.max_aliases} aliases" in error.message


def test_an_alias_inside_the_node_it_names_is_refused() -> None:
    error = _only(_errors(SPEC_YAML + "policy: {params: {u_low: &loop [*loop]}}\n"))
    assert "alias *loop refers to a node that contains it" in error.message


def test_limits_are_arguments_of_the_parser() -> None:
    small = DocumentLimits(max_bytes=10_000, max_depth=5, max_nodes=20, max_aliases=1)
    assert "more than 20 values" in _only(_errors(SPEC_YAML, limits=small)).message
    shallow = DocumentLimits(max_depth=3)
    assert "deeper than 3 levels" in _only(_errors(_minimal(), limits=shallow)).message
    assert parse_spec(SPEC_YAML, limits=DocumentLimits(max_depth=5, max_nodes=50)).name == "job-1"


# -- size and nesting (finding 3) ---------------------------------------------------------------------


def test_a_document_over_the_size_limit_is_refused_before_it_is_parsed() -> None:
    limits = DocumentLimits(max_bytes=len(SPEC_YAML.encode()))
    assert parse_spec(SPEC_YAML, limits=limits).name == "job-1"
    for bigger in (SPEC_YAML + " ", SPEC_YAML.replace("job-1", "jöb-1")):  # one character, one byte more
        error = _only(_errors(bigger, limits=limits))
        assert (
            error.message == f"the document is larger than {limits.max_bytes} bytes, the most a spec may be"
        )


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_deep_nesting_is_a_spec_error_in_yaml_json_and_mappings(depth: int) -> None:
    yaml_text = SPEC_YAML + "policy: {params: {u_low: " + "[" * depth + "]" * depth + "}}\n"
    json_text = json.dumps(_minimal())[:-1] + ', "policy": ' + "[" * depth + "]" * depth + "}"
    nested: list[Any] = []
    for _ in range(depth):
        nested = [nested]
    mapping = {**_minimal(), "policy": nested}
    for document in (yaml_text, json_text, mapping):
        error = _only(_errors(document))
        assert error.path == "" and f"deeper than {DEFAULT_LIMITS.max_depth} levels" in error.message


def test_nesting_is_counted_the_same_way_for_every_input() -> None:
    limits = DocumentLimits(max_depth=4)
    at_limit = {"a": {"b": [1]}}  # the mapping 1, its value 2, the list 3, the scalar 4
    check_document_bounds(at_limit, limits)
    load_document(json.dumps(at_limit), limits=limits)
    load_document(yaml.safe_dump(at_limit), limits=limits)
    past = {"a": {"b": [[1]]}}
    for document in (past, json.dumps(past), yaml.safe_dump(past)):
        with pytest.raises(SpecError, match="deeper than 4 levels"):
            if isinstance(document, str):
                load_document(document, limits=limits)
            else:
                check_document_bounds(document, limits)


def test_too_many_values_are_refused_in_json_and_mappings() -> None:
    many = {**_minimal(), "policy": {"params": {"u_low": [0] * DEFAULT_LIMITS.max_nodes}}}
    for document in (many, json.dumps(many)):
        assert "more than 20000 values" in _only(_errors(document)).message


def test_a_structure_sharing_itself_is_walked_at_most_to_the_limit() -> None:
    shared: list[Any] = ["x"] * 10
    for _ in range(8):
        shared = [shared] * 10  # 10**9 values when expanded, a few hundred objects in memory
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    for value in (shared, cyclic):
        with pytest.raises(SpecError, match=r"values|levels"):
            check_document_bounds({**_minimal(), "policy": {"params": {"u_low": value}}})


def test_values_python_cannot_build_are_spec_errors_at_their_line() -> None:
    cases = {
        "u_low: 2024-13-45": "cannot read this value: month must be in 1..12",
        "u_low: " + "9" * 5000: "an integer of more than 100 characters",
        "u_low: 1" + ":1" * 5000: "an integer of more than 100 characters",  # YAML 1.1 base 60
    }
    for line, fragment in cases.items():
        error = _only(_errors(SPEC_YAML + "policy:\n  params:\n    " + line + "\n"))
        assert error.path == "" and fragment in error.message and "line 8" in error.message, error
    error = _only(_errors('{"name": ' + "9" * 5000 + "}"))
    assert error.message.startswith("JSON value cannot be read: Exceeds the limit (4300 digits)")


def test_a_json_key_written_twice_is_refused() -> None:
    text = json.dumps(_minimal())[:-1] + ', "name": "other"}'
    assert _only(_errors(text)).message == "JSON object has a duplicate key 'name'"


def test_json_without_javascripts_constants() -> None:
    text = json.dumps(_minimal())[:-1] + ', "tick_seconds": NaN}'
    assert _only(_errors(text)).message == "NaN is not JSON (write a number)"


# -- rank ranges are checked before they are expanded (finding 3) --------------------------------------


def test_a_huge_range_is_refused_without_being_expanded() -> None:
    document = _minimal()
    document["components"][0] = {"name": "rollout", "kind": "rollout", "placement": "0-9999999"}
    with memory_ceiling(GIB // 4):  # expanded, the old list of ten million ranks took 730 MB
        error = _only(_errors(document))
    assert error.path == "components[0].placement"
    assert error.message == f"'0-9999999' names a rank above {MAX_GPU_RANKS - 1}, the highest a spec may name"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (f"0-{MAX_GPU_RANKS}", f"range 0-{MAX_GPU_RANKS} goes above rank {MAX_GPU_RANKS - 1}"),
        ("0-" + "9" * 5000, "names a rank above"),
        pytest.param(10**4000, "is above", id="a 4001-digit integer"),
        (MAX_GPU_RANKS, "is above"),
    ],
)
def test_ranks_past_the_largest_a_spec_may_name(value: object, fragment: str) -> None:
    with pytest.raises(RankError, match=fragment) as caught:
        parse_gpu_ranks(value, None)
    assert len(str(caught.value)) < 200


def test_all_over_a_huge_cluster_is_refused() -> None:
    with pytest.raises(RankError, match=f"at most {MAX_GPU_RANKS}"):
        parse_gpu_ranks("all", 10**9)
    assert len(parse_gpu_ranks(f"0-{MAX_GPU_RANKS - 1}", None)) == MAX_GPU_RANKS


def test_an_rlinf_config_spanning_a_huge_cluster_is_refused_before_all_is_expanded() -> None:
    config = yaml.safe_load((REPO / "examples" / "rlinf-disaggregated.yaml").read_text())
    config["cluster"]["num_nodes"] = 1_000_000
    config["cluster"]["component_placement"] = {"actor,rollout,reward": "all"}
    with memory_ceiling(GIB // 4):
        errors = _errors(config)
    assert [e.path for e in errors] == ["cluster.num_nodes"]
    assert f"a spec may span at most {MAX_GPU_RANKS}" in errors[0].message


def test_rlinf_process_ranks_are_bounded_too() -> None:
    config = yaml.safe_load((REPO / "examples" / "rlinf-disaggregated.yaml").read_text())
    config["cluster"]["component_placement"]["actor"] = "0-3:0-9999999"
    errors = _errors(config)
    assert any(
        e.path == "cluster.component_placement.actor" and "process ranks '0-9999999'" in e.message
        for e in errors
    ), errors


# -- integers the database cannot store (finding 3) ----------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda d: d.update(workload={"iterations": 2**64}), "workload.iterations"),
        (lambda d: d["components"][0].update(max_workers=2**63), "components[0].max_workers"),
        (lambda d: d["components"][0].update(workers=INTEGER_MAX + 1), "components[0].workers"),
        (lambda d: d["components"][0].update(parallelism={"tp": 2**40}), "components[0].parallelism.tp"),
        (lambda d: d.update(priority=2**31), "priority"),
    ],
)
def test_integers_past_a_32_bit_column_are_refused_at_their_key(edit: Any, path: str) -> None:
    document = _minimal()
    edit(document)
    for source in (document, json.dumps(document)):
        error = _only(_errors(source))
        assert error.path == path and "must be at most 2147483647" in error.message, error


def test_integers_past_a_float_are_refused_at_their_key() -> None:
    document = _minimal()
    document["model"]["params_b"] = 10**400
    document["policy"] = {"name": "dynarl", "params": {"u_low": 10**400}}
    errors = _errors(json.dumps(document))
    assert [e.path for e in errors] == ["model.params_b", "policy.params.u_low"]
    assert all(len(e.message) < 200 for e in errors)


def test_rlinf_integers_past_a_32_bit_column_are_refused_at_their_key() -> None:
    config = yaml.safe_load((REPO / "examples" / "rlinf-disaggregated.yaml").read_text())
    config["runner"]["max_steps"] = 2**64
    assert _only(_errors(config)).path == "runner.max_steps"


# -- messages never echo an unbounded value (finding 2) ------------------------------------------------


def test_long_values_are_cut_short_in_messages_and_paths() -> None:
    long_key = "k" * 100_000
    document = _minimal()
    document[long_key] = 1
    document["components"][0]["placement"] = "x" * 100_000
    del document["components"][0]["workers"]
    document["components"][1]["depends_on"] = ["r" * 100_000]
    document["policy"] = {"name": "p" * 100_000, "params": {}}
    errors = _errors(document)
    assert len(errors) == 4
    assert all(len(e.path) <= MAX_PATH_CHARS and len(e.message) <= 300 for e in errors), errors


def test_every_field_error_is_bounded() -> None:
    error = FieldError("a" * 10_000, "b" * 10_000)
    assert (len(error.path), len(error.message)) == (MAX_PATH_CHARS, MAX_MESSAGE_CHARS)


def test_a_document_of_thousands_of_bad_keys_lists_the_first_and_counts_the_rest() -> None:
    document = _minimal()
    document.update({f"unknown{i}": i for i in range(5_000)})
    errors = _errors(document)
    assert len(errors) == MAX_REPORTED_PROBLEMS + 1
    assert errors[-1] == FieldError("", f"and {5_000 - MAX_REPORTED_PROBLEMS} more problems not listed")


# -- trace paths (finding 9) ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trace", "fragment"),
    [
        ("../../../../etc/shadow", "must not climb out of the agents' trace directory with '..'"),
        ("runs/../../secret.jsonl", "with '..'"),
        ("/etc/shadow", "relative to the agents' trace directory (--trace-dir), not an absolute path"),
        ("trace\x00.jsonl", "must not contain a NUL byte"),
    ],
)
def test_trace_paths_the_control_plane_can_tell_are_refused(trace: str, fragment: str) -> None:
    document = _minimal()
    document["workload"] = {"trace": trace}
    error = _only(_errors(document))
    assert error.path == "workload.trace" and fragment in error.message

    config = yaml.safe_load((REPO / "examples" / "rlinf-disaggregated.yaml").read_text())
    config["dynarl"] = {"trace": trace}
    error = _only(_errors(config))
    assert error.path == "dynarl.trace" and fragment in error.message


def test_relative_trace_paths_under_the_trace_directory_are_accepted() -> None:
    document = _minimal()
    for trace in ("episodes.jsonl", "runs/2026/run..1.jsonl", "./a/b.jsonl"):
        document["workload"] = {"trace": trace}
        assert parse_spec(copy.deepcopy(document)).workload.trace == trace
