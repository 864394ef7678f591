"""RLinf configs translated into job specs, and their problems named by RLinf key path."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.spec import (
    ComponentSpec,
    FieldError,
    JobSpec,
    ModelSpec,
    PolicySpec,
    SpecError,
    WorkloadSpec,
    parse_spec,
    parse_spec_file,
)
from jobs.spec import policy as spec_policy
from jobs.spec.rlinf import infer_params_b, is_rlinf_config
from scheduler.core.hypergraph import ComponentKind

REPO = Path(__file__).resolve().parents[2]


def _config(placement: dict[str, Any] | None = None, **cluster: Any) -> dict[str, Any]:
    """A small disaggregated RLinf config on one 8-GPU node, without the dynamic scheduler."""
    return {
        "cluster": {
            "num_nodes": 1,
            "component_placement": placement if placement is not None else {"actor": "0-1", "rollout": "2-7"},
            **cluster,
        },
        "runner": {"max_steps": 5, "experiment_name": "small"},
        "rollout": {"model_dir": "/models/Qwen2.5-1.5B/", "tensor_parallel_size": 1},
        "actor": {"model": {"tensor_model_parallel_size": 1}},
    }


def _errors(document: Any, **kwargs: Any) -> list[FieldError]:
    with pytest.raises(SpecError) as caught:
        parse_spec(document, **kwargs)
    return caught.value.errors


def _messages_at(errors: list[FieldError], path: str) -> list[str]:
    return [e.message for e in errors if e.path == path]


def _load(name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((REPO / "examples" / name).read_text())
    assert isinstance(loaded, dict)
    return loaded


# -- detection ------------------------------------------------------------------------------------


def test_detection_needs_cluster_with_component_placement() -> None:
    assert is_rlinf_config(_config())
    assert not is_rlinf_config({"cluster": {"num_nodes": 1}})
    assert not is_rlinf_config({"cluster": "big", "name": "x"})
    assert not is_rlinf_config({"name": "x", "components": []})


def test_a_dynarl_spec_with_a_cluster_key_is_not_taken_for_rlinf() -> None:
    document = {
        "name": "x",
        "cluster": {"num_nodes": 1},
        "model": {"name": "m", "params_b": 1},
        "components": [
            {"name": "rollout", "kind": "rollout", "workers": 1},
            {"name": "a", "kind": "actor", "workers": 1},
        ],
    }
    assert [e.path for e in _errors(document)] == ["cluster"]


def test_infer_params_b_reads_the_size_token() -> None:
    assert infer_params_b("DeepSeek-R1-Distill-Qwen-7B") == 7.0
    assert infer_params_b("qwen2.5-1.5b") == 1.5
    assert infer_params_b("Qwen3-30B-A3B") == 30.0
    assert infer_params_b("Qwen2.5-32B-Instruct") == 32.0
    assert infer_params_b("Mixtral-8x7B") is None
    assert infer_params_b("my-model") is None


# -- the examples ---------------------------------------------------------------------------------


def test_disaggregated_example_with_auto_scheduler() -> None:
    everywhere = tuple(range(16))
    expected = JobSpec(
        name="qwen7b-dynamic",
        priority=0,
        backend="sim",
        model=ModelSpec(name="DeepSeek-R1-Distill-Qwen-7B", params_b=7.0),
        workload=WorkloadSpec(
            kind="math",
            iterations=20,
            prompts_per_iteration=512,
            samples_per_prompt=16,
            max_new_tokens=28672 - 1024,
            staleness=0,
        ),
        components=(
            ComponentSpec(
                name="actor",
                kind=ComponentKind.ACTOR,
                tp=4,
                placement=(0, 1, 2, 3),
                depends_on=("rollout", "inference", "reward"),
                colocated_with=("reward",),
            ),
            ComponentSpec(
                name="rollout",
                kind=ComponentKind.ROLLOUT,
                tp=2,
                placement=tuple(range(4, 14)),
                colocated_with=("reward",),
            ),
            ComponentSpec(
                name="inference",
                kind=ComponentKind.INFERENCE,
                tp=2,
                placement=(14, 15),
                depends_on=("rollout",),
                colocated_with=("reward",),
            ),
            ComponentSpec(
                name="reward",
                kind=ComponentKind.REWARD,
                placement=everywhere,
                depends_on=("rollout",),
                colocated_with=("actor", "rollout", "inference"),
            ),
        ),
        policy=PolicySpec(
            name="rlinf-auto",
            params={
                "use_pre_process_policy": True,
                "use_wait_before_last_iter_policy": False,
                "pre_process_running_fraction": 0.2,
                "max_running_requests": 100,  # rollout.max_running_requests 128 capped by migrate_out_max_bs
                "n_minibatches": 4,
            },
        ),
        tick_seconds=1.0,
        source_format="rlinf",
    )
    parsed = parse_spec_file(REPO / "examples" / "rlinf-disaggregated.yaml")
    assert parsed == expected
    assert [c.worker_count for c in parsed.components] == [1, 5, 1, 16]
    assert parsed.total_gpus == 16


def test_colocated_example_runs_static_colocated() -> None:
    parsed = parse_spec_file(REPO / "examples" / "rlinf-colocated.yaml")
    assert parsed.source_format == "rlinf"
    assert parsed.policy == PolicySpec(name="static-colocated", params={})
    assert [c.name for c in parsed.components] == ["actor", "rollout", "reward"]
    assert {c.placement for c in parsed.components} == {tuple(range(8))}
    assert parsed.component("actor").colocated_with == ("rollout", "reward")
    assert (parsed.component("actor").worker_count, parsed.component("rollout").worker_count) == (4, 4)
    assert parsed.workload.iterations == 3  # max_steps -1: one iteration per epoch
    assert parsed.workload.max_new_tokens == 1536
    assert (parsed.workload.prompts_per_iteration, parsed.workload.samples_per_prompt) == (64, 2)
    assert parsed.model == ModelSpec(name="DeepSeek-R1-Distill-Qwen-1.5B", params_b=1.5)
    assert parsed.name == "grpo-1.5b"


def test_node_group_example_maps_groups_to_the_gpus_of_their_node_ranks() -> None:
    parsed = parse_spec_file(REPO / "examples" / "rlinf-hetero.yaml")
    actor, rollout = parsed.component("actor"), parsed.component("rollout")
    # A label names nodes, not hardware: the GPUs are whatever nodes 0-1 and 2 have.
    assert (actor.placement, actor.hardware, actor.worker_count) == (tuple(range(16)), (), 2)
    assert (rollout.placement, rollout.hardware, rollout.worker_count) == (tuple(range(16, 24)), (), 2)
    assert (parsed.name, parsed.priority) == ("qwen32b-hetero", 10)
    assert parsed.policy == PolicySpec(name="dynarl", params={"u_low": 0.25})
    assert parsed.model.params_b == 32.0
    assert parsed.workload.max_new_tokens == 8192 - 1024


def test_rlinf_spec_round_trips_with_its_source_format() -> None:
    parsed = parse_spec_file(REPO / "examples" / "rlinf-disaggregated.yaml")
    stored = json.loads(json.dumps(parsed.to_json()))
    assert stored["source_format"] == "rlinf"
    assert JobSpec.from_json(stored) == parsed


def test_json_text_of_an_rlinf_config_is_translated_too() -> None:
    document = _load("rlinf-colocated.yaml")
    assert parse_spec(json.dumps(document)) == parse_spec_file(REPO / "examples" / "rlinf-colocated.yaml")


# -- ranges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        ("2-7", tuple(range(2, 8))),
        ("2-3,6-7", (2, 3, 6, 7)),
        ("2-4,6,15", (2, 3, 4, 6, 15)),
        (9, (9,)),
        ("2-7:0-11", tuple(range(2, 8))),  # process ranks are dropped
        ("2-3:0-1,4-7:2-5", tuple(range(2, 8))),
    ],
)
def test_range_forms(rollout: Any, expected: tuple[int, ...]) -> None:
    document = _config({"actor": "0-1", "rollout": rollout}, num_nodes=2)
    assert parse_spec(document).component("rollout").placement == expected


def test_all_uses_num_gpus_per_node() -> None:
    document = _config({"actor,rollout": "all"}, num_nodes=2, num_gpus_per_node=4)
    parsed = parse_spec(document)
    assert parsed.component("actor").placement == tuple(range(8))
    assert parsed.total_gpus == 8


@pytest.mark.parametrize(
    ("rollout", "fragment"),
    [
        ("9-12", "range 9-12 exceeds the cluster's 8 GPUs (ranks 0-7)"),
        ("8", "rank 8 exceeds the cluster's 8 GPUs"),
        ("7-2", "range 7-2 is reversed"),
        ("2-5,4-7", "rank 4 is listed twice"),
        ("2-x", "is not a rank or a range"),
        ("2-7:5-1", "process ranks '5-1': range 5-1 is reversed"),
        ([2, 3], "must be a rank list"),
    ],
)
def test_bad_ranges_are_named_by_their_key(rollout: Any, fragment: str) -> None:
    errors = _errors(_config({"actor": "0-1", "rollout": rollout}))
    messages = _messages_at(errors, "cluster.component_placement.rollout")
    assert any(fragment in m for m in messages), errors


def test_partial_overlap_is_neither_colocated_nor_disaggregated() -> None:
    errors = _errors(_config({"actor": "0-3", "rollout": "2-7"}))
    assert [e.path for e in errors] == ["cluster.component_placement"]
    assert errors[0].message.startswith("neither colocated")
    assert "actor 0-3, rollout 2-7" in errors[0].message


def test_inference_overlapping_the_rollout_is_refused() -> None:
    errors = _errors(_config({"actor": "0-1", "rollout": "2-5", "inference": "5-7"}))
    assert [e.path for e in errors] == ["cluster.component_placement"]


def test_a_component_placed_twice() -> None:
    errors = _errors(_config({"actor": "0-1", "rollout": "2-7", "actor,reward": "0-7"}))
    assert _messages_at(errors, "cluster.component_placement.actor,reward") == [
        "component 'actor' is placed twice (also under 'actor')"
    ]


def test_unknown_component_names_are_refused() -> None:
    errors = _errors(_config({"actor": "0-1", "rollout": "2-5", "critic": "6-7"}))
    messages = _messages_at(errors, "cluster.component_placement.critic")
    assert len(messages) == 1
    assert messages[0].startswith("unknown component 'critic'")


def test_missing_actor_is_reported_at_component_placement() -> None:
    errors = _errors(_config({"rollout": "0-7"}))
    assert _messages_at(errors, "cluster.component_placement") == [
        "needs exactly one actor component, found 0"
    ]


def test_placement_not_a_whole_number_of_engines() -> None:
    document = _config({"actor": "0-2", "rollout": "3-7"})
    document["rollout"]["tensor_parallel_size"] = 2
    errors = _errors(document)
    assert _messages_at(errors, "cluster.component_placement.rollout") == [
        "5 GPUs (3-7) are not a whole number of workers of tp x pp = 2 GPUs"
    ]


# -- colocation keys and the three switches --------------------------------------------------------


def test_colocated_key_without_auto_scheduler_is_static_colocated() -> None:
    parsed = parse_spec(_config({"actor,rollout": "0-7"}))
    assert parsed.policy.name == "static-colocated"
    assert parsed.component("rollout").colocated_with == ("actor",)
    assert parsed.component("rollout").placement == parsed.component("actor").placement


def test_same_ranks_under_separate_keys_are_colocated_too() -> None:
    parsed = parse_spec(_config({"actor": "all", "rollout": "all"}))
    assert parsed.policy.name == "static-colocated"
    assert parsed.component("actor").colocated_with == ("rollout",)


def test_disaggregated_without_auto_scheduler_is_static_disaggregated() -> None:
    parsed = parse_spec(_config(auto_scheduler=False))
    assert parsed.policy == PolicySpec(name="static-disaggregated", params={})
    assert parsed.component("actor").colocated_with == ()


def test_auto_scheduler_switches_become_rlinf_auto_params() -> None:
    document = _config(
        auto_scheduler=True, use_pre_process_policy=False, use_wait_before_last_iter_policy=True
    )
    parsed = parse_spec(document)
    assert parsed.policy == PolicySpec(
        name="rlinf-auto",
        params={"use_pre_process_policy": False, "use_wait_before_last_iter_policy": True},
    )


def test_absent_switches_keep_the_policy_defaults() -> None:
    parsed = parse_spec(_config(auto_scheduler=True))
    assert parsed.policy == PolicySpec(name="rlinf-auto", params={})


def test_auto_scheduler_needs_a_disaggregated_placement() -> None:
    errors = _errors(_config({"actor,rollout": "all"}, auto_scheduler=True))
    assert _messages_at(errors, "cluster.auto_scheduler") == [
        "needs a disaggregated placement (actor, rollout and inference on disjoint GPUs)"
    ]


@pytest.mark.parametrize(
    ("placement", "fragment"),
    [
        ({"rollout": "0-5", "actor": "6-7"}, "actor holds 6-7, expected it to start at GPU 0"),
        ({"actor": "0-1", "rollout": "3-7"}, "rollout holds 3-7, expected it to start at GPU 2"),
        ({"actor": "0-1", "rollout": "2-5"}, "cover all 8 GPUs; they end at GPU 5"),
        (
            {"actor": "0-1", "inference": "2-3", "rollout": "4-7"},
            "rollout holds 4-7, expected it to start at GPU 2",
        ),
    ],
)
def test_auto_scheduler_needs_actor_rollout_inference_in_order(
    placement: dict[str, str], fragment: str
) -> None:
    errors = _errors(_config(placement, auto_scheduler=True))
    messages = _messages_at(errors, "cluster.auto_scheduler")
    assert len(messages) == 1 and fragment in messages[0], errors


def test_pre_process_policy_needs_whole_engines_on_the_actor_gpus() -> None:
    document = _config({"actor": "0-2", "rollout": "3-6", "inference": "7"}, auto_scheduler=True)
    document["rollout"]["tensor_parallel_size"] = 2
    errors = _errors(document)
    assert _messages_at(errors, "cluster.use_pre_process_policy") == [
        "lends the actor's 3 GPUs to rollout engines of 2 GPUs each; 3 is not a multiple of 2"
    ]
    document["cluster"]["use_pre_process_policy"] = False
    assert parse_spec(document).policy.params == {"use_pre_process_policy": False}


def test_bad_switch_values_are_named() -> None:
    errors = _errors(_config(auto_scheduler="yes", preprocess_threshold=1.5))
    assert _messages_at(errors, "cluster.auto_scheduler") == ["must be true or false, got a string ('yes')"]


def test_auto_params_out_of_range_are_named_by_their_rlinf_key() -> None:
    document = _config(auto_scheduler=True, preprocess_threshold=1.5, migrate_out_max_bs=0)
    document["algorithm"] = {"n_minibatches": 0}
    document["rollout"]["max_running_requests"] = 64
    errors = _errors(document)
    assert sorted(e.path for e in errors) == [
        "algorithm.n_minibatches",
        "cluster.migrate_out_max_bs",
        "cluster.preprocess_threshold",
    ]


def test_policy_refusals_map_back_to_the_rlinf_key(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusal(ValueError):
        def __init__(self, param: str) -> None:
            super().__init__(f"{param} refused")
            self.param = param

    def build(name: str, **kwargs: Any) -> object:
        for param in kwargs["params"]:
            if param in ("n_minibatches", "u_low"):
                raise Refusal(param)
        return object()

    registry = spec_policy.PolicyRegistry(names=("rlinf-auto", "dynarl"), build=build)
    monkeypatch.setattr(spec_policy, "policy_registry", lambda: registry)
    document = _config(auto_scheduler=True)
    document["algorithm"] = {"n_minibatches": 4}
    document["dynarl"] = {"policy_params": {"u_low": 0.1}}
    errors = _errors(document)
    assert [(e.path, e.message) for e in errors] == [
        ("algorithm.n_minibatches", "n_minibatches refused"),
        ("dynarl.policy_params.u_low", "u_low refused"),
    ]


# -- node groups ----------------------------------------------------------------------------------


def _hetero(placement: dict[str, Any], groups: list[dict[str, Any]], num_nodes: int = 3) -> dict[str, Any]:
    document = _config(placement, num_nodes=num_nodes)
    document["cluster"]["node_groups"] = groups
    return document


GROUPS: list[dict[str, Any]] = [{"label": "a800", "node_ranks": "0-1"}, {"label": 4090, "node_ranks": 2}]


def test_node_group_ranks_count_within_the_group_and_labels_are_not_hardware() -> None:
    document = _hetero(
        {
            "actor": {"node_group": "a800", "placement": "8-15"},
            "rollout": {"node_group": 4090, "placement": "all"},
        },
        GROUPS,
    )
    parsed = parse_spec(document)
    assert parsed.component("actor").placement == tuple(range(8, 16))
    assert parsed.component("rollout").placement == tuple(range(16, 24))
    assert parsed.component("actor").hardware == parsed.component("rollout").hardware == ()


def test_a_placement_over_several_node_groups_counts_on_across_them_in_order() -> None:
    groups = [{"label": "b", "node_ranks": 2}, {"label": "a", "node_ranks": 0}]
    for written in ("b,a", ["b", "a"]):
        document = _hetero({"actor": "8-15", "rollout": {"node_group": written, "placement": "4-11"}}, groups)
        # Group ranks 0-7 are node 2's GPUs (16-23), 8-15 node 0's (0-7).
        assert parse_spec(document).component("rollout").placement == (*range(0, 4), *range(20, 24))


def test_the_cluster_group_is_every_node() -> None:
    document = _hetero({"actor": "0-7", "rollout": {"node_group": "cluster", "placement": "8-23"}}, [])
    assert parse_spec(document).component("rollout").placement == tuple(range(8, 24))


def test_node_group_with_scattered_nodes() -> None:
    document = _hetero(
        {"actor": "0-3", "rollout": {"node_group": "odd", "placement": "6-9"}},
        [{"label": "odd", "node_ranks": "1,3"}],
        num_nodes=4,
    )
    # The group's GPUs are node 1's (8-15) then node 3's (24-31); local 6-9 is 14,15,24,25.
    assert parse_spec(document).component("rollout").placement == (14, 15, 24, 25)


@pytest.mark.parametrize(
    ("placement", "groups", "path", "fragment"),
    [
        (
            {"actor": {"node_group": "a800", "placement": "0-16"}, "rollout": "16-23"},
            GROUPS,
            "cluster.component_placement.actor.placement",
            "range 0-16 exceeds the 16 GPUs of node group 'a800' (ranks 0-15)",
        ),
        (
            {"actor": {"node_group": "h100", "placement": "0-7"}, "rollout": "16-23"},
            GROUPS,
            "cluster.component_placement.actor.node_group",
            "unknown node group 'h100'",
        ),
        (
            {"actor": {"node_group": "a800"}, "rollout": "16-23"},
            GROUPS,
            "cluster.component_placement.actor.placement",
            "is required",
        ),
        (
            {"actor": "0-7", "rollout": "8-15", "agent": {"node_group": "node", "placement": "0-1:0-200"}},
            GROUPS,
            "cluster.component_placement.agent.node_group",
            "whole nodes",
        ),
        (
            {"actor": "0-7", "rollout": "8-15", "env": {"node_group": "franka", "placement": "0-1"}},
            [{"label": "franka", "node_ranks": 2, "hardware": {"type": "Franka"}}],
            "cluster.component_placement.env.node_group",
            "provides Franka hardware, not GPUs",
        ),
        (
            {"actor": "0-7", "rollout": "8-15"},
            [{"label": "a800", "node_ranks": "0-3"}],
            "cluster.node_groups[0].node_ranks",
            "range 0-3 exceeds the cluster's 3 nodes",
        ),
        (
            {"actor": "0-7", "rollout": "8-15"},
            [{"label": "a800", "node_ranks": 0}, {"label": "a800", "node_ranks": 1}],
            "cluster.node_groups[1].label",
            "defined twice",
        ),
        (
            {"actor": "0-7", "rollout": "8-15"},
            [{"node_ranks": 0}],
            "cluster.node_groups[0].label",
            "is required",
        ),
        (
            {"actor": "0-7", "rollout": "8-15"},
            [{"label": "cluster", "node_ranks": 0}],
            "cluster.node_groups[0].label",
            "'cluster' is reserved by RLinf",
        ),
        (
            {"actor": "0-7", "rollout": {"node_group": "cpu", "placement": "0"}},
            [{"label": "cpu", "node_ranks": 2, "ignore_hardware": True}],
            "cluster.component_placement.rollout.node_group",
            "provides CPU-only nodes (ignore_hardware), not GPUs",
        ),
        (
            {"actor": "0-7", "rollout": {"node_group": "arms", "placement": "0"}},
            [{"label": "arms", "node_ranks": 2, "hardware_type": "Franka"}],
            "cluster.component_placement.rollout.node_group",
            "provides Franka hardware, not GPUs",
        ),
        (
            {"actor": "0-7", "rollout": {"node_group": "a800,wide", "placement": "0-7"}},
            [{"label": "a800", "node_ranks": "0-1"}, {"label": "wide", "node_ranks": "1-2"}],
            "cluster.component_placement.rollout.node_group",
            "node groups 'a800' and 'wide' share GPU 8",
        ),
        (
            {"actor": "0-7", "rollout": {"node_group": ["a800", "a800"], "placement": "0-7"}},
            GROUPS,
            "cluster.component_placement.rollout.node_group",
            "names node group 'a800' twice",
        ),
        (
            {"actor": "0-7", "rollout": {"node_group": "a800,4090", "placement": "0-24"}},
            GROUPS,
            "cluster.component_placement.rollout.placement",
            "range 0-24 exceeds the 24 GPUs of node groups 'a800' + '4090'",
        ),
    ],
)
def test_bad_node_groups(
    placement: dict[str, Any], groups: list[dict[str, Any]], path: str, fragment: str
) -> None:
    errors = _errors(_hetero(placement, groups))
    assert any(fragment in m for m in _messages_at(errors, path)), errors


# -- workload, model, name and the dynarl section --------------------------------------------------


def test_workload_keys() -> None:
    document = _config()
    document["runner"] = {"max_steps": -1, "max_epochs": 7, "seq_length": 4096}
    document["data"] = {"rollout_batch_size": 32, "max_prompt_length": 1000}
    document["algorithm"] = {"group_size": 4, "sampling_params": {"max_new_tokens": 2048}}
    workload = parse_spec(document).workload
    assert (workload.iterations, workload.prompts_per_iteration, workload.samples_per_prompt) == (7, 32, 4)
    assert workload.max_new_tokens == 2048


def test_max_new_tokens_falls_back_to_seq_length_minus_prompt_length() -> None:
    document = _config()
    document["runner"]["seq_length"] = 4096
    document["data"] = {"max_prompt_length": 1000}
    document["algorithm"] = {"sampling_params": {"max_new_tokens": "${subtract:${runner.seq_length},1000}"}}
    assert parse_spec(document).workload.max_new_tokens == 3096
    document["data"]["max_prompt_length"] = 4096
    assert _messages_at(_errors(document), "runner.seq_length") == [
        "must exceed data.max_prompt_length (4096), got 4096"
    ]


def test_plain_references_are_followed_and_resolvers_refused() -> None:
    document = _config({"actor": "0-3", "rollout": "4-7"})
    document["actor"]["model"]["tensor_model_parallel_size"] = 2
    document["rollout"]["tensor_parallel_size"] = "${actor.model.tensor_model_parallel_size}"
    assert parse_spec(document).component("rollout").tp == 2
    document["rollout"]["tensor_parallel_size"] = "${multiply:1,2}"
    assert _messages_at(_errors(document), "rollout.tensor_parallel_size") == [
        "'${multiply:1,2}' is an interpolation dynarl does not evaluate; write the value itself"
    ]
    document["rollout"]["tensor_parallel_size"] = "${rollout.tensor_parallel_size}"
    assert _errors(document)[0].path == "rollout.tensor_parallel_size"  # a reference cycle


def test_parallelism_keys() -> None:
    document = _config({"actor": "0-3", "rollout": "4-5", "inference": "6-7"})
    document["actor"]["model"] = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    document["rollout"].update(tensor_parallel_size=1, pipeline_parallel_size=2)
    document["inference"] = {"model": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}}
    parsed = parse_spec(document)
    assert [(c.name, c.tp, c.pp, c.worker_count) for c in parsed.components] == [
        ("actor", 2, 2, 1),
        ("rollout", 1, 2, 1),
        ("inference", 1, 1, 2),
    ]
    document["actor"]["model"]["tensor_model_parallel_size"] = 0
    assert _messages_at(_errors(document), "actor.model.tensor_model_parallel_size") == [
        "must be at least 1, got 0"
    ]


def test_inference_inherits_the_actor_split() -> None:
    document = _config({"actor": "0-3", "rollout": "4-5", "inference": "6-7"})
    document["actor"]["model"] = {"tensor_model_parallel_size": 2}
    assert parse_spec(document).component("inference").tp == 2


def test_env_and_agent_become_tools_and_make_the_workload_agentic() -> None:
    parsed = parse_spec(_config({"actor": "0-3", "rollout": "4-5", "env": "6", "agent": "7"}))
    assert [c.kind for c in parsed.components_of(ComponentKind.TOOL)] == [ComponentKind.TOOL] * 2
    assert parsed.component("env").depends_on == ("rollout",)
    assert parsed.workload.kind == "agentic"
    assert (parsed.workload.max_turns, parsed.workload.tool_latency_s) == (8, 1.0)


def test_model_without_a_stated_size_needs_model_params_b() -> None:
    document = _config()
    document["rollout"]["model_dir"] = "/models/my-model"
    assert _messages_at(_errors(document), "dynarl.model_params_b")[0].startswith("is needed")
    document["dynarl"] = {"model_params_b": 3}
    assert parse_spec(document).model == ModelSpec(name="my-model", params_b=3.0)


def test_missing_model_path_is_named() -> None:
    document = _config()
    del document["rollout"]["model_dir"]
    assert [e.path for e in _errors(document)] == ["rollout.model_dir"]
    document["dynarl"] = {"model_name": "llama-3-8b"}
    assert parse_spec(document).model == ModelSpec(name="llama-3-8b", params_b=8.0)


def test_templated_experiment_name_falls_back_to_the_model() -> None:
    document = _config()
    document["runner"]["experiment_name"] = "${cluster.num_nodes}node-grpo"
    assert parse_spec(document).name == "rlinf-Qwen2.5-1.5B"
    document["runner"]["experiment_name"] = "has spaces"
    assert _messages_at(_errors(document), "runner.experiment_name")[0].startswith("must be 1-100 characters")


def test_the_dynarl_section_overrides_what_rlinf_does_not_say() -> None:
    document = _config()
    document["dynarl"] = {
        "name": "renamed",
        "priority": 3,
        "backend": "sim",
        "tick_seconds": 0.5,
        "workload_kind": "agentic",
        "staleness": 2,
        "trace": "traces/run.jsonl",
        "max_turns": 4,
        "policy": "bidirectional",
    }
    parsed = parse_spec(document)
    assert (parsed.name, parsed.priority, parsed.backend, parsed.tick_seconds) == ("renamed", 3, "sim", 0.5)
    assert parsed.workload.kind == "agentic"
    assert (parsed.workload.staleness, parsed.workload.trace, parsed.workload.max_turns) == (
        2,
        "traces/run.jsonl",
        4,
    )
    assert parsed.policy == PolicySpec(name="bidirectional", params={})


def test_monitor_interval_sets_the_tick() -> None:
    assert parse_spec(_config(monitor_interval=2)).tick_seconds == 2.0


def test_problems_in_the_dynarl_section() -> None:
    document = _config(auto_scheduler=True, use_pre_process_policy=True)
    document["dynarl"] = {
        "nmae": "x",
        "backend": "k8s",
        "max_turns": 3,
        "policy_params": {"use_pre_process_policy": False},
    }
    errors = _errors(document)
    assert sorted(e.path for e in errors) == [
        "dynarl.backend",
        "dynarl.max_turns",
        "dynarl.nmae",
        "dynarl.policy_params.use_pre_process_policy",
    ]
    assert "did you mean 'name'" in _messages_at(errors, "dynarl.nmae")[0]
    assert _messages_at(errors, "dynarl.policy_params.use_pre_process_policy") == [
        "is already set by cluster.use_pre_process_policy; set it in one place"
    ]


def test_unknown_policy_in_the_dynarl_section() -> None:
    document = _config()
    document["dynarl"] = {"policy": "greedy"}
    assert _messages_at(_errors(document), "dynarl.policy")[0].startswith("unknown policy 'greedy'")


# -- cluster size and several problems at once ------------------------------------------------------


def test_num_nodes_is_required_and_checked_against_the_cluster() -> None:
    document = _config()
    del document["cluster"]["num_nodes"]
    assert [e.path for e in _errors(document)] == ["cluster.num_nodes"]
    document["cluster"]["num_nodes"] = 2
    assert _messages_at(_errors(document, cluster_gpus=8), "cluster.num_nodes") == [
        "the config spans 16 GPUs (2 nodes x 8); the cluster has 8"
    ]
    assert parse_spec(document, cluster_gpus=16).source_format == "rlinf"


def test_bad_num_nodes_does_not_cascade_into_all() -> None:
    errors = _errors(_config({"actor,rollout": "all"}, num_nodes=0))
    assert [e.path for e in errors] == ["cluster.num_nodes"]


def test_unused_rlinf_keys_are_ignored_but_read_ones_are_checked() -> None:
    document = _config(assign_policy="greedy", anything_else={"deep": [1, 2]})
    document["hydra"] = {"run": {"dir": "."}}
    document["actor"]["optim"] = {"lr": "2e-5"}
    assert parse_spec(document).source_format == "rlinf"
    document["data"] = {"rollout_batch_size": "512"}
    assert [e.path for e in _errors(document)] == ["data.rollout_batch_size"]


def test_sections_of_the_wrong_type_are_reported_once() -> None:
    document = _config()
    document["rollout"] = "sglang"
    errors = _errors(document)
    assert [e.path for e in errors].count("rollout") == 1


def test_several_rlinf_problems_are_reported_together() -> None:
    document = copy.deepcopy(_load("rlinf-disaggregated.yaml"))
    document["cluster"]["component_placement"]["inference"] = "14-17"
    document["cluster"]["component_placement"]["critic"] = "0-1"
    document["algorithm"]["group_size"] = 0
    document["rollout"]["tensor_parallel_size"] = "2"
    document["dynarl"] = {"priority": 1.5}
    errors = _errors(document)
    assert sorted(e.path for e in errors) == [
        "algorithm.group_size",
        "cluster.component_placement.critic",
        "cluster.component_placement.inference",
        "dynarl.priority",
        "rollout.tensor_parallel_size",
    ]
    assert (
        "range 14-17 exceeds the cluster's 16 GPUs"
        in _messages_at(errors, "cluster.component_placement.inference")[0]
    )


def test_a_ray_job_must_be_written_in_dynarls_format() -> None:
    """RLinf's config has no place for the runtime (model, task, training) a real job runs."""
    document = _config()
    document["dynarl"] = {"backend": "ray"}
    assert _messages_at(_errors(document), "dynarl.backend")[0].startswith(
        "jobs on the ray backend are written"
    )
