"""RLinf training configs as dynarl job specs.

RLinf describes a run with a large Hydra/YAML config; its ``cluster`` section says where each
component runs (``component_placement``) and whether RLinf's dynamic scheduler is on
(``auto_scheduler`` and its two policy switches). dynarl reads the keys it needs from such a
config, checks them, and builds the same ``JobSpec`` its own format produces, with
``source_format="rlinf"``. Keys dynarl does not use are ignored (full RLinf configs are large);
every key it reads is checked and a problem is reported at that RLinf key path, for example
``cluster.component_placement.rollout: range 9-12 exceeds the cluster's 8 GPUs (ranks 0-7)``.

An optional top-level ``dynarl`` section carries what RLinf does not say (job name, priority,
backend, the model size, a different policy); it belongs to dynarl, so its keys are strict.
The full mapping is documented in ``docs/job-spec.md``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final

from jobs.spec.components import Draft, check_components
from jobs.spec.errors import Problems, RankError
from jobs.spec.model import (
    BACKENDS,
    COLOCATED_POLICY,
    JOB_NAME_PATTERN,
    MAX_TICK_SECONDS,
    PRIORITY_MAX,
    PRIORITY_MIN,
    WORKLOAD_KINDS,
    JobSpec,
    ModelSpec,
    PolicySpec,
    WorkloadSpec,
)
from jobs.spec.policy import check_policy
from jobs.spec.ranks import MAX_GPU_RANKS, format_gpu_ranks, parse_gpu_ranks
from jobs.spec.sections import ABSENT, REPORTED, Marker, Section
from jobs.spec.values import describe, shown, suggestion
from jobs.spec.workload import read_workload
from scheduler.core.hypergraph import ComponentKind

DEFAULT_GPUS_PER_NODE: Final = 8
PLACEMENT_PATH: Final = "cluster.component_placement"

# RLinf component names dynarl schedules, and the kind each becomes.
RLINF_COMPONENTS: Final[Mapping[str, ComponentKind]] = {
    "actor": ComponentKind.ACTOR,
    "rollout": ComponentKind.ROLLOUT,
    "inference": ComponentKind.INFERENCE,
    "actor_inference": ComponentKind.INFERENCE,
    "reward": ComponentKind.REWARD,
    "env": ComponentKind.TOOL,
    "agent": ComponentKind.TOOL,
}
# RLinf's reserved node-group labels: "cluster" is every node, and "node" places processes on
# whole nodes (CPU processes), not on GPUs.
CLUSTER_GROUP: Final = "cluster"
NODE_LEVEL_GROUP: Final = "node"
RESERVED_GROUP_LABELS: Final = (CLUSTER_GROUP, NODE_LEVEL_GROUP)
# RLinf's hardware type of accelerators (GPUs, NPUs): what a group's ranks count unless it says otherwise.
ACCELERATOR_HARDWARE: Final = "Accelerator"

DYNARL_SECTION_KEYS: Final = (
    "name",
    "priority",
    "backend",
    "tick_seconds",
    "model_name",
    "model_params_b",
    "workload_kind",
    "staleness",
    "trace",
    "max_turns",
    "tool_latency_s",
    "policy",
    "policy_params",
)

# rlinf-auto policy parameter -> the RLinf key it comes from (for error paths).
AUTO_PARAM_SOURCES: Final[Mapping[str, str]] = {
    "use_pre_process_policy": "cluster.use_pre_process_policy",
    "use_wait_before_last_iter_policy": "cluster.use_wait_before_last_iter_policy",
    "max_running_requests": "rollout.max_running_requests",
    "n_minibatches": "algorithm.n_minibatches",
    "pre_process_running_fraction": "cluster.preprocess_threshold",
}

_UNRESOLVED: Final = Marker("<unresolved>")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)\}")
# "7B", "1.5b", "32B" as a separate token of a model name ("Qwen2.5-7B-Instruct").
_PARAM_COUNT = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)[bB](?![A-Za-z0-9])")
_MAX_REFERENCE_DEPTH = 16


def is_rlinf_config(document: Mapping[Any, Any]) -> bool:
    """RLinf's format is recognised by a top-level ``cluster`` mapping with ``component_placement``."""
    cluster = document.get("cluster")
    return isinstance(cluster, Mapping) and "component_placement" in cluster


def infer_params_b(model_name: str) -> float | None:
    """The parameter count (billions) a model name states, such as 7.0 for "Qwen2.5-7B-Instruct"."""
    match = _PARAM_COUNT.search(model_name)
    return float(match.group(1)) if match else None


# -- reading with Hydra references resolved -------------------------------------------------------


def _lookup(root: Mapping[Any, Any], dotted: str) -> Any:
    node: Any = root
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ABSENT
        node = node[part]
    return node


def _resolve(value: Any, root: Mapping[Any, Any]) -> Any:
    """Follow plain ``${a.b.c}`` references; anything else with ``${`` (resolvers such as
    ``${subtract:...}``, string templates) cannot be evaluated here and is ``_UNRESOLVED``."""
    for _ in range(_MAX_REFERENCE_DEPTH):
        if not isinstance(value, str) or "${" not in value:
            return value
        match = _REFERENCE.fullmatch(value.strip())
        if match is None:
            return _UNRESOLVED
        value = _lookup(root, match.group(1))
        if value is ABSENT:
            return _UNRESOLVED
    return _UNRESOLVED  # a reference cycle


class _RLinfSection(Section):
    """A section of an RLinf config: references are resolved before a value is checked."""

    def __init__(
        self, data: Mapping[Any, Any], path: str, problems: Problems, root: Mapping[Any, Any]
    ) -> None:
        super().__init__(data, path, problems)
        self.root = root
        self._sections: dict[str, _RLinfSection] = {}

    def child(self, data: Mapping[Any, Any], path: str) -> _RLinfSection:
        return _RLinfSection(data, path, self.problems, self.root)

    def raw(self, key: str) -> Any:
        written = super().raw(key)
        value = _resolve(written, self.root)
        if value is _UNRESOLVED:
            self.fail(
                key, f"{shown(written)} is an interpolation dynarl does not evaluate; write the value itself"
            )
            return REPORTED
        return value

    def peek(self, key: str) -> Any:
        """The resolved value, or ``ABSENT`` when missing or not evaluable (no problem recorded)."""
        value = _resolve(super().raw(key), self.root)
        return ABSENT if value is _UNRESOLVED else value

    def section(self, key: str) -> _RLinfSection:
        """A nested section, empty when absent (a wrong type is reported, once)."""
        if key not in self._sections:
            found = self.mapping(key)
            self._sections[key] = (
                found
                if isinstance(found, _RLinfSection)
                else _RLinfSection({}, self.path_of(key), self.problems, self.root)
            )
        return self._sections[key]


# -- the translation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NodeGroup:
    """An RLinf node group: a label naming a set of node ranks (not a hardware type)."""

    label: str
    gpus: tuple[int, ...]  # global GPU ranks of the group's nodes (its node_ranks), in node-rank order
    other_hardware: str | None  # what its ranks count when not GPUs (robots, CPU-only nodes)


@dataclass
class _Placed:
    """One ``component_placement`` entry."""

    key: str
    names: tuple[str, ...]
    ranks: tuple[int, ...] | None  # global GPU ranks; None when the entry is bad

    @property
    def path(self) -> str:
        return f"{PLACEMENT_PATH}.{self.key}"


class _RLinfPaths:
    """Every component-level problem is fixed in that component's placement entry."""

    def __init__(self, entry_of: Mapping[str, _Placed]) -> None:
        self.entry_of = entry_of

    def components(self) -> str:
        return PLACEMENT_PATH

    def field(self, draft: Draft, name: str) -> str:
        entry = self.entry_of.get(draft.name or "")
        return entry.path if entry is not None else PLACEMENT_PATH


@dataclass
class _Overrides:
    """The ``dynarl`` section: what RLinf's config does not say."""

    section: _RLinfSection
    name: str | None
    priority: int | None
    backend: str | None
    tick_seconds: float | None
    model_name: str | None
    model_params_b: float | None
    workload_kind: str | None
    policy: str | None
    policy_params: dict[str, Any] | None


def translate_rlinf(document: Mapping[Any, Any], *, cluster_gpus: int | None = None) -> JobSpec:
    """Build a ``JobSpec`` from an RLinf config; raises ``SpecError`` naming RLinf key paths."""
    problems = Problems()
    root = _RLinfSection(document, "", problems, document)
    overrides = _read_overrides(root)
    cluster = root.section("cluster")

    num_nodes = cluster.integer("num_nodes", required=True, minimum=1)
    gpus_per_node = cluster.integer("num_gpus_per_node", DEFAULT_GPUS_PER_NODE, minimum=1)
    total_gpus = num_nodes * gpus_per_node if num_nodes is not None and gpus_per_node is not None else None
    if total_gpus is not None and total_gpus > MAX_GPU_RANKS:
        # Refused before any rank list is expanded against it.
        cluster.fail(
            "num_nodes",
            f"the config spans {total_gpus} GPUs ({num_nodes} nodes x {gpus_per_node}); a spec may span at most "
            f"{MAX_GPU_RANKS}",
        )
        num_nodes = gpus_per_node = total_gpus = None
    if cluster_gpus is not None and total_gpus is not None and total_gpus > cluster_gpus:
        cluster.fail(
            "num_nodes",
            f"the config spans {total_gpus} GPUs ({num_nodes} nodes x {gpus_per_node}); the cluster has {cluster_gpus}",
        )
    groups = _read_node_groups(cluster, num_nodes, gpus_per_node)
    entries = _read_placement(cluster, total_gpus, groups)
    entry_of = {name: entry for entry in entries for name in entry.names}

    rollout = root.section("rollout")
    drafts = _drafts(root, entries, entry_of)

    ranks_of = {name: entry.ranks for name, entry in entry_of.items()}
    mode = _placement_mode(ranks_of, problems)

    auto = cluster.boolean("auto_scheduler", False)
    policy_name, name_path = _policy_name(overrides, auto, mode)
    policy_params: dict[str, Any] | None = {}
    if policy_name == "rlinf-auto":
        _check_auto_placement(cluster, ranks_of, mode, total_gpus, drafts)
        policy_params = _auto_params(root, cluster, rollout)
    policy_params = _overlay_policy_params(policy_params, overrides)

    check_components(
        drafts,
        policy_name=policy_name,
        cluster_gpus=total_gpus,
        problems=problems,
        paths=_RLinfPaths(entry_of),
    )

    model = _model(rollout, overrides)
    workload = _workload(root, overrides, drafts)
    name = _job_name(root, overrides, model)
    tick_seconds = overrides.tick_seconds
    if tick_seconds is None and not overrides.section.has("tick_seconds"):
        tick_seconds = cluster.number("monitor_interval", 1.0, above=0.0, maximum=MAX_TICK_SECONDS)

    def param_path(param: str) -> str:
        # A parameter is set in exactly one place (the overlay refuses both).
        if overrides.policy_params is not None and param in overrides.policy_params:
            return f"dynarl.policy_params.{param}"
        return AUTO_PARAM_SOURCES.get(param, f"dynarl.policy_params.{param}")

    check_policy(
        policy_name,
        policy_params,
        model_params_b=model.params_b if model is not None else None,
        problems=problems,
        name_path=name_path,
        param_path=param_path,
        params_path="dynarl.policy_params" if overrides.section.has("policy_params") else name_path,
    )
    if overrides.backend == "ray":
        # A real job needs dynarl's runtime section (model, task, training), which RLinf's config lacks.
        problems.add(
            "dynarl.backend",
            "jobs on the ray backend are written in dynarl's format (with its runtime section)",
        )
    problems.raise_if_any()
    assert name is not None and model is not None and workload is not None and policy_name is not None
    assert policy_params is not None and tick_seconds is not None
    assert overrides.priority is not None and overrides.backend is not None
    return JobSpec(
        name=name,
        priority=overrides.priority,
        backend=overrides.backend,
        model=model,
        workload=workload,
        components=tuple(d.build() for d in drafts),
        policy=PolicySpec(name=policy_name, params=policy_params),
        tick_seconds=tick_seconds,
        source_format="rlinf",
    )


def _read_overrides(root: _RLinfSection) -> _Overrides:
    section = root.section("dynarl")
    section.reject_unknown(DYNARL_SECTION_KEYS)
    kind = section.string("workload_kind", None, choices=WORKLOAD_KINDS)
    policy_params: dict[str, Any] | None = {}
    params_section = section.mapping("policy_params")
    if params_section is not None:
        policy_params = {}
        for key, value in params_section.data.items():
            if not isinstance(key, str):
                params_section.problems.add(
                    params_section.path, f"parameter names must be strings, got {describe(key)}"
                )
                policy_params = None
                break
            policy_params[key] = value
    elif section.has("policy_params"):
        policy_params = None
    return _Overrides(
        section=section,
        name=section.string(
            "name",
            None,
            pattern=JOB_NAME_PATTERN,
            pattern_hint="must be 1-100 characters of A-Z a-z 0-9 . _ -",
        ),
        priority=section.integer("priority", 0, minimum=PRIORITY_MIN, maximum=PRIORITY_MAX),
        backend=section.string("backend", "sim", choices=BACKENDS),
        tick_seconds=section.number("tick_seconds", None, above=0.0, maximum=MAX_TICK_SECONDS),
        model_name=section.string("model_name", None, max_length=200),
        model_params_b=section.number("model_params_b", None, above=0.0),
        workload_kind=kind,
        policy=section.string("policy", None),
        policy_params=policy_params,
    )


def _read_node_groups(
    cluster: _RLinfSection, num_nodes: int | None, gpus_per_node: int | None
) -> dict[str, _NodeGroup] | None:
    """Label -> group; None when the node groups are unreadable (already reported)."""
    items = cluster.sequence("node_groups")
    if items is None:
        return None if cluster.has("node_groups") else {}
    groups: dict[str, _NodeGroup] = {}
    ok = True
    for position, item in enumerate(items):
        path = f"{cluster.path_of('node_groups')}[{position}]"
        if not isinstance(item, Mapping):
            cluster.problems.add(path, f"must be a mapping, got {describe(item)}")
            ok = False
            continue
        entry = cluster.child(item, path)
        label = _label(entry, "label", required=True)
        if label in RESERVED_GROUP_LABELS:
            entry.fail(
                "label",
                f"{label!r} is reserved by RLinf ({', '.join(RESERVED_GROUP_LABELS)}); choose another",
            )
            label = None
        node_ranks: tuple[int, ...] | None = None
        written = entry.raw("node_ranks")
        if written is ABSENT:
            entry.fail("node_ranks", "is required")
        elif written is not REPORTED:
            try:
                node_ranks = parse_gpu_ranks(
                    written, num_nodes, capacity=f"the cluster's {num_nodes} nodes (cluster.num_nodes)"
                )
            except RankError as exc:
                entry.fail("node_ranks", str(exc))
        other_hardware = _other_hardware(entry)
        if label is None or node_ranks is None or gpus_per_node is None:
            ok = False
            continue
        if label in groups:
            entry.fail("label", f"node group {label!r} is defined twice")
            ok = False
            continue
        # Node rank k holds global GPU ranks k*G .. k*G+G-1 (docs/job-spec.md, "Node ranks").
        gpus = tuple(node * gpus_per_node + local for node in node_ranks for local in range(gpus_per_node))
        groups[label] = _NodeGroup(label=label, gpus=gpus, other_hardware=other_hardware)
    return groups if ok else None


def _label(section: _RLinfSection, key: str, *, required: bool = False) -> str | None:
    """A node-group label; YAML reads ``4090`` as an integer, RLinf treats it as a name."""
    value = section.raw(key)
    if value is ABSENT:
        if required:
            section.fail(key, "is required")
        return None
    if value is REPORTED:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        section.fail(key, f"must be a node-group label (a name), got {describe(value)}")
        return None
    return str(value)


def _other_hardware(entry: _RLinfSection) -> str | None:
    """What a node group's placement ranks count when they are not its nodes' GPUs: RLinf's
    ``hardware`` block (robots: its ``type``), a ``hardware_type`` other than accelerators, or
    ``ignore_hardware: true`` (CPU-only). None for GPUs. The GPUs' model is never stated here: it
    is whatever the nodes at those ranks have."""
    written = entry.peek("hardware")
    if written is not ABSENT and written is not None:
        if isinstance(written, Mapping) and isinstance(written.get("type"), str):
            return f"{written['type']} hardware"
        return "non-GPU hardware"
    hardware_type = entry.peek("hardware_type")
    if isinstance(hardware_type, str) and hardware_type != ACCELERATOR_HARDWARE:
        return f"{hardware_type} hardware"
    if entry.peek("ignore_hardware") is True:
        return "CPU-only nodes (ignore_hardware)"
    return None


def _read_placement(
    cluster: _RLinfSection, total_gpus: int | None, groups: Mapping[str, _NodeGroup] | None
) -> list[_Placed]:
    placement = cluster.mapping("component_placement")
    if not isinstance(placement, _RLinfSection):
        return []
    if not placement.data:
        cluster.fail(
            "component_placement", "places no component; RLinf needs at least the actor and the rollout"
        )
        return []
    entries: list[_Placed] = []
    placed_under: dict[str, str] = {}
    for key in placement.data:
        if not isinstance(key, str):
            placement.problems.add(placement.path, f"component names must be strings, got {describe(key)}")
            continue
        names = tuple(part.strip() for part in key.split(","))
        names_ok = True
        for name in names:
            if name not in RLINF_COMPONENTS:
                placement.fail(
                    key,
                    f"unknown component {shown(name)}{suggestion(name, RLINF_COMPONENTS)}; dynarl schedules "
                    f"{', '.join(RLINF_COMPONENTS)}",
                )
                names_ok = False
            elif name in placed_under:
                placement.fail(
                    key, f"component {name!r} is placed twice (also under {shown(placed_under[name])})"
                )
                names_ok = False
            else:
                placed_under[name] = key
        if not names_ok:
            continue
        entries.append(_Placed(key=key, names=names, ranks=_entry_ranks(placement, key, total_gpus, groups)))
    return entries


def _entry_ranks(
    placement: _RLinfSection, key: str, total_gpus: int | None, groups: Mapping[str, _NodeGroup] | None
) -> tuple[int, ...] | None:
    """The entry's global GPU ranks; None when bad (already reported).

    In the node-group form the ranks count the GPUs of the group's nodes, in node-rank order;
    several groups (``node_group: "a800,4090"`` or a list) count on across them in the order
    given, as in RLinf. A group names nodes, not a hardware type: no hardware affinity follows.
    """
    value = placement.raw(key)
    if value is REPORTED:
        return None
    if not isinstance(value, Mapping):
        return _ranks(placement, key, value, total_gpus, None)
    entry = placement.child(value, placement.path_of(key))
    labels = _group_labels(entry)
    written = entry.raw("placement")
    if written is ABSENT:
        entry.fail("placement", "is required in the node-group form (resource ranks within the group)")
        return None
    if labels is None or written is REPORTED:
        return None
    chosen = _chosen_groups(entry, labels, total_gpus, groups)
    if chosen is None:
        return None
    gpus = tuple(gpu for group in chosen for gpu in group.gpus)
    names = " + ".join(repr(g.label) for g in chosen)
    what = f"node group {names}" if len(chosen) == 1 else f"node groups {names}"
    local = _ranks(entry, "placement", written, len(gpus), f"the {len(gpus)} GPUs of {what}")
    if local is None:
        return None
    return tuple(sorted(gpus[rank] for rank in local))


def _group_labels(entry: _RLinfSection) -> tuple[str, ...] | None:
    """``node_group``: one label, several joined by commas, or a list of labels."""
    written = entry.peek("node_group")
    if isinstance(written, list):
        labels: list[str] = []
        for item in written:
            if isinstance(item, bool) or not isinstance(item, str | int) or item == "":
                entry.fail("node_group", f"must list node-group labels (names), got {describe(item)}")
                return None
            labels.append(str(item))
    else:
        label = _label(entry, "node_group", required=True)
        if label is None:
            return None
        labels = [part.strip() for part in label.split(",")]
    if not labels or "" in labels:
        entry.fail("node_group", "names an empty node-group label")
        return None
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        entry.fail("node_group", f"names node group {repeated[0]!r} twice")
        return None
    return tuple(labels)


def _chosen_groups(
    entry: _RLinfSection,
    labels: Sequence[str],
    total_gpus: int | None,
    groups: Mapping[str, _NodeGroup] | None,
) -> list[_NodeGroup] | None:
    """The node groups ``labels`` name (RLinf's ``cluster`` is every node); None when one is bad."""
    if NODE_LEVEL_GROUP in labels:
        entry.fail(
            "node_group",
            f"node group {NODE_LEVEL_GROUP!r} places processes on whole nodes; dynarl schedules GPU workers only",
        )
        return None
    if groups is None:
        return None  # the node groups are unreadable; that is already reported
    chosen: list[_NodeGroup] = []
    for label in labels:
        if label == CLUSTER_GROUP:
            if total_gpus is None:
                return None  # the cluster size is bad, and that is reported at cluster.num_nodes
            chosen.append(_NodeGroup(CLUSTER_GROUP, tuple(range(total_gpus)), None))
            continue
        group = groups.get(label)
        if group is None:
            known = ", ".join(repr(g) for g in groups) or "none"
            entry.fail(
                "node_group",
                f"unknown node group {label!r}{suggestion(label, groups)} (cluster.node_groups: {known})",
            )
            return None
        if group.other_hardware is not None:
            entry.fail(
                "node_group",
                f"node group {label!r} provides {group.other_hardware}, not GPUs; dynarl schedules GPU workers only",
            )
            return None
        chosen.append(group)
    seen: dict[int, str] = {}
    for group in chosen:
        for gpu in group.gpus:
            if gpu in seen:
                entry.fail(
                    "node_group",
                    f"node groups {seen[gpu]!r} and {group.label!r} share GPU {gpu}; name each node once",
                )
                return None
            seen[gpu] = group.label
    return chosen


def _ranks(
    section: _RLinfSection, key: str, value: Any, limit: int | None, capacity: str | None
) -> tuple[int, ...] | None:
    """Resource ranks of ``resource[:process]`` entries; process ranks are checked, then dropped
    (dynarl counts workers as GPUs / (tp x pp), one engine or trainer rank group each)."""
    if limit is None and isinstance(value, str) and value.strip() == "all":
        return None  # the cluster size itself is bad, and that is reported at cluster.num_nodes
    try:
        resources = _without_process_ranks(value)
        return parse_gpu_ranks(resources, limit, capacity=capacity)
    except RankError as exc:
        section.fail(key, str(exc))
        return None


def _without_process_ranks(value: Any) -> Any:
    if not isinstance(value, str) or ":" not in value:
        return value
    resources: list[str] = []
    for part in value.split(","):
        resource, _, processes = part.partition(":")
        if processes:
            try:
                parse_gpu_ranks(processes, None)
            except RankError as exc:
                raise RankError(f"process ranks {shown(processes.strip())}: {exc}") from exc
        resources.append(resource)
    return ",".join(resources)


def _drafts(root: _RLinfSection, entries: Sequence[_Placed], entry_of: Mapping[str, _Placed]) -> list[Draft]:
    parallelism = _parallelism(root, entry_of)
    kinds = {name: RLINF_COMPONENTS[name] for name in entry_of}
    rollouts = tuple(n for n, k in kinds.items() if k is ComponentKind.ROLLOUT)
    feeders = tuple(n for n, k in kinds.items() if k in (ComponentKind.INFERENCE, ComponentKind.REWARD))

    drafts: list[Draft] = []
    for entry in entries:
        for name in entry.names:
            kind = kinds[name]
            if kind is ComponentKind.ROLLOUT:
                depends_on: tuple[str, ...] = ()
            elif kind is ComponentKind.ACTOR:
                depends_on = rollouts + feeders
            else:
                depends_on = rollouts
            shares_with = tuple(
                other.names
                for other in entries
                if entry.ranks is not None and other.ranks is not None and set(entry.ranks) & set(other.ranks)
            )
            colocated = tuple(n for names in shares_with for n in names if n != name)
            tp, pp = parallelism.get(name, (1, 1))
            drafts.append(
                Draft(
                    index=len(drafts),
                    name=name,
                    kind=kind,
                    tp=tp,
                    pp=pp,
                    placement=entry.ranks,
                    uses_placement=True,
                    count_ok=entry.ranks is not None,
                    min_workers=1,
                    depends_on=tuple(enumerate(depends_on)),
                    colocated_with=tuple(enumerate(colocated)),
                )
            )
    return drafts


def _parallelism(
    root: _RLinfSection, entry_of: Mapping[str, _Placed]
) -> dict[str, tuple[int | None, int | None]]:
    """(tp, pp) per placed model component, from the keys RLinf's placement reads them from."""
    result: dict[str, tuple[int | None, int | None]] = {}
    actor_model = root.section("actor").section("model")
    actor_tp = actor_model.integer("tensor_model_parallel_size", 1, minimum=1)
    actor_pp = actor_model.integer("pipeline_model_parallel_size", 1, minimum=1)
    if "actor" in entry_of:
        result["actor"] = (actor_tp, actor_pp)
    if "rollout" in entry_of:
        rollout = root.section("rollout")
        result["rollout"] = (
            rollout.integer("tensor_parallel_size", 1, minimum=1),
            rollout.integer("pipeline_parallel_size", 1, minimum=1),
        )
    for name in ("inference", "actor_inference"):
        if name in entry_of:
            # RLinf: an inference group without its own sizes runs the actor's model split.
            model = root.section(name).section("model")
            result[name] = (
                model.integer("tensor_model_parallel_size", actor_tp, minimum=1),
                model.integer("pipeline_model_parallel_size", actor_pp, minimum=1),
            )
    return result


def _placement_mode(ranks_of: Mapping[str, tuple[int, ...] | None], problems: Problems) -> str | None:
    """ "colocated" (actor and rollout on the same GPUs) or "disaggregated" (actor, rollout and
    inference pairwise disjoint), as RLinf's model-parallel placement decides; None otherwise."""
    model_parallel = ("actor", "rollout", "inference", "actor_inference")
    if any(name in ranks_of and ranks_of[name] is None for name in model_parallel):
        return None  # a bad placement is already reported; judging the mode without it would mislead
    actor, rollout = ranks_of.get("actor"), ranks_of.get("rollout")
    if actor is None or rollout is None:
        return None
    if set(actor) == set(rollout):
        return "colocated"
    inference = ranks_of.get("inference") or ranks_of.get("actor_inference") or ()
    groups = [set(actor), set(rollout), set(inference)]
    if all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :]):
        return "disaggregated"
    problems.add(
        PLACEMENT_PATH,
        f"neither colocated (actor and rollout on the same GPUs) nor disaggregated (actor, rollout and inference on "
        f"disjoint GPUs): actor {format_gpu_ranks(actor)}, rollout {format_gpu_ranks(rollout)}"
        + (f", inference {format_gpu_ranks(inference)}" if inference else ""),
    )
    return None


def _policy_name(overrides: _Overrides, auto: bool | None, mode: str | None) -> tuple[str | None, str]:
    """The policy and the key path that chose it."""
    if overrides.section.has("policy"):
        return overrides.policy, "dynarl.policy"
    if auto:
        return "rlinf-auto", "cluster.auto_scheduler"
    if auto is None or mode is None:
        return None, "cluster.auto_scheduler"  # already reported
    return (COLOCATED_POLICY if mode == "colocated" else "static-disaggregated"), PLACEMENT_PATH


def _check_auto_placement(
    cluster: _RLinfSection,
    ranks_of: Mapping[str, tuple[int, ...] | None],
    mode: str | None,
    total_gpus: int | None,
    drafts: Sequence[Draft],
) -> None:
    """RLinf's auto mode: disaggregated, and actor -> rollout -> inference back to back over all GPUs."""
    if mode is None:
        return
    if mode != "disaggregated":
        cluster.fail(
            "auto_scheduler",
            "needs a disaggregated placement (actor, rollout and inference on disjoint GPUs)",
        )
        return
    order = [name for name in ("actor", "rollout", "inference", "actor_inference") if ranks_of.get(name)]
    expected_next = 0
    for name in order:
        ranks = ranks_of[name]
        assert ranks is not None
        if ranks != tuple(range(expected_next, expected_next + len(ranks))):
            cluster.fail(
                "auto_scheduler",
                f"needs the order actor -> rollout -> inference back to back from GPU 0; {name} holds "
                f"{format_gpu_ranks(ranks)}, expected it to start at GPU {expected_next}",
            )
            return
        expected_next += len(ranks)
    if total_gpus is not None and expected_next != total_gpus:
        cluster.fail(
            "auto_scheduler",
            f"needs actor, rollout and inference to cover all {total_gpus} GPUs; they end at GPU {expected_next - 1}",
        )
        return
    pre_process = cluster.peek("use_pre_process_policy")
    actor_gpus = ranks_of.get("actor")
    rollout = next((d for d in drafts if d.name == "rollout"), None)
    per_engine = rollout.gpus_per_worker if rollout is not None else None
    # RLinf's scheduler defaults the switch to on; then the actor's GPUs host whole rollout engines.
    if pre_process is not False and actor_gpus and per_engine and len(actor_gpus) % per_engine:
        cluster.fail(
            "use_pre_process_policy",
            f"lends the actor's {len(actor_gpus)} GPUs to rollout engines of {per_engine} GPUs each; "
            f"{len(actor_gpus)} is not a multiple of {per_engine}",
        )


def _auto_params(
    root: _RLinfSection, cluster: _RLinfSection, rollout: _RLinfSection
) -> dict[str, Any] | None:
    """rlinf-auto's parameters from the RLinf keys that set them; absent keys keep the policy's
    defaults, which are RLinf's scheduler defaults."""
    params: dict[str, Any] = {}
    ok = True
    for param in ("use_pre_process_policy", "use_wait_before_last_iter_policy"):
        if cluster.has(param):
            value = cluster.boolean(param)
            ok = ok and value is not None
            params[param] = value
    if cluster.has("preprocess_threshold"):
        threshold = cluster.number("preprocess_threshold", minimum=0.0, maximum=1.0)
        ok = ok and threshold is not None
        params["pre_process_running_fraction"] = threshold
    if rollout.has("max_running_requests"):
        running = rollout.integer("max_running_requests", minimum=1)
        # RLinf caps each migration batch at cluster.migrate_out_max_bs.
        cap = (
            cluster.integer("migrate_out_max_bs", None, minimum=1)
            if cluster.has("migrate_out_max_bs")
            else None
        )
        ok = ok and running is not None and (cap is not None or not cluster.has("migrate_out_max_bs"))
        if running is not None:
            params["max_running_requests"] = min(running, cap) if cap is not None else running
    algorithm = root.section("algorithm")
    if algorithm.has("n_minibatches"):
        minibatches = algorithm.integer("n_minibatches", minimum=1)
        ok = ok and minibatches is not None
        params["n_minibatches"] = minibatches
    return params if ok else None


def _overlay_policy_params(derived: dict[str, Any] | None, overrides: _Overrides) -> dict[str, Any] | None:
    if derived is None or overrides.policy_params is None:
        return None
    merged = dict(derived)
    for key, value in overrides.policy_params.items():
        if key in derived:
            source = AUTO_PARAM_SOURCES.get(key, key)
            overrides.section.problems.add(
                f"dynarl.policy_params.{key}", f"is already set by {source}; set it in one place"
            )
            return None
        merged[key] = value
    return merged


def _model(rollout: _RLinfSection, overrides: _Overrides) -> ModelSpec | None:
    name = overrides.model_name
    if name is None and not overrides.section.has("model_name"):
        name = _model_name_from_paths(rollout)
        if name is None:
            rollout.fail(
                "model_dir",
                "no model path (rollout.model_dir or rollout.model.model_path); set dynarl.model_name",
            )
    if name is None:
        return None
    params_b = overrides.model_params_b
    if params_b is None and not overrides.section.has("model_params_b"):
        params_b = infer_params_b(name)
        if params_b is None:
            overrides.section.fail(
                "model_params_b",
                f"is needed: the model name {name!r} does not state a size such as 7B; give billions of parameters",
            )
    if params_b is None:
        return None
    return ModelSpec(name=name, params_b=params_b)


def _model_name_from_paths(rollout: _RLinfSection) -> str | None:
    candidates = [
        rollout.peek("model_dir"),
        rollout.section("model").peek("model_path"),
    ]
    for candidate in candidates:
        if isinstance(candidate, str) and candidate.strip():
            base = PurePosixPath(candidate.strip().rstrip("/")).name
            if base:
                return base[:200]
    return None


def _workload(root: _RLinfSection, overrides: _Overrides, drafts: Sequence[Draft]) -> WorkloadSpec | None:
    runner = root.section("runner")
    data = root.section("data")
    algorithm = root.section("algorithm")
    section = overrides.section

    max_steps = runner.integer("max_steps", -1, minimum=-1)
    max_epochs = runner.integer("max_epochs", None, minimum=1)
    if max_steps is not None and max_steps > 0:
        iterations: int | None = max_steps
    elif max_steps == 0:
        runner.fail("max_steps", "must be -1 (derive from max_epochs) or a positive step count, got 0")
        iterations = None
    else:
        # Without the dataset size an epoch's step count is unknown; one iteration per epoch.
        iterations = max_epochs if max_epochs is not None else (None if runner.has("max_epochs") else 10)

    prompts = data.integer("rollout_batch_size", 512, minimum=1)
    samples = algorithm.integer("group_size", 8, minimum=1)
    max_new_tokens = _max_new_tokens(runner, data, algorithm)

    tool_present = any(d.kind is ComponentKind.TOOL for d in drafts)
    kind = overrides.workload_kind
    if kind is None and not section.has("workload_kind"):
        kind = "agentic" if tool_present else "math"
    return read_workload(
        section,
        kind=kind,
        iterations=iterations,
        prompts_per_iteration=prompts,
        samples_per_prompt=samples,
        max_new_tokens=max_new_tokens,
        not_agentic="only applies to agentic workloads (this one is {kind!r})",
    )


def _max_new_tokens(runner: _RLinfSection, data: _RLinfSection, algorithm: _RLinfSection) -> int | None:
    sampling = algorithm.section("sampling_params")
    if sampling.peek("max_new_tokens") is not ABSENT:
        return sampling.integer("max_new_tokens", minimum=1)
    # RLinf's configs usually write ${subtract:${runner.seq_length},${data.max_prompt_length}}.
    seq_length = runner.integer("seq_length", None, minimum=1)
    prompt_length = data.integer("max_prompt_length", None, minimum=1)
    if seq_length is None:
        return None if runner.has("seq_length") else 8192
    if prompt_length is None:
        return None if data.has("max_prompt_length") else seq_length
    if seq_length <= prompt_length:
        runner.fail("seq_length", f"must exceed data.max_prompt_length ({prompt_length}), got {seq_length}")
        return None
    return seq_length - prompt_length


def _job_name(root: _RLinfSection, overrides: _Overrides, model: ModelSpec | None) -> str | None:
    if overrides.section.has("name"):
        return overrides.name
    runner = root.section("runner")
    experiment = runner.peek("experiment_name")
    if experiment is not ABSENT:
        # A literal experiment name is the job's name; a templated one falls back to the model's.
        return runner.string(
            "experiment_name",
            pattern=JOB_NAME_PATTERN,
            pattern_hint="must be 1-100 characters of A-Z a-z 0-9 . _ - (or set dynarl.name)",
        )
    base = model.name if model is not None else "job"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-") or "job"
    return f"rlinf-{slug}"[:100]
