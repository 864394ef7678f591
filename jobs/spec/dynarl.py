"""dynarl's own spec format: top-level ``name``, ``model``, ``workload``, ``components``, ``policy``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from jobs.spec.components import Draft, check_components
from jobs.spec.errors import Problems, RankError
from jobs.spec.model import (
    BACKENDS,
    COMPONENT_NAME_PATTERN,
    DEFAULT_POLICY,
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
from jobs.spec.ranks import parse_gpu_ranks
from jobs.spec.runtime import read_runtime
from jobs.spec.sections import INTEGER_MAX, Section
from jobs.spec.values import describe, is_int
from jobs.spec.workload import read_workload
from scheduler.core.hypergraph import ComponentKind

TOP_LEVEL_KEYS: Final = (
    "name",
    "priority",
    "backend",
    "model",
    "workload",
    "components",
    "policy",
    "tick_seconds",
    "runtime",
)
MODEL_KEYS: Final = ("name", "params_b")
WORKLOAD_KEYS: Final = (
    "kind",
    "iterations",
    "prompts_per_iteration",
    "samples_per_prompt",
    "max_new_tokens",
    "staleness",
    "trace",
    "max_turns",
    "tool_latency_s",
)
COMPONENT_KEYS: Final = (
    "name",
    "kind",
    "parallelism",
    "workers",
    "placement",
    "min_workers",
    "max_workers",
    "hardware",
    "depends_on",
    "colocated_with",
)
PARALLELISM_KEYS: Final = ("tp", "pp", "valid_dp")
POLICY_KEYS: Final = ("name", "params")


class _DynarlPaths:
    def components(self) -> str:
        return "components"

    def field(self, draft: Draft, name: str) -> str:
        if name == "count":
            name = "placement" if draft.uses_placement else "workers"
        return f"components[{draft.index}].{name}"


def parse_dynarl(document: Mapping[Any, Any], *, cluster_gpus: int | None) -> JobSpec:
    """Build a ``JobSpec`` from a document in dynarl's format; raises ``SpecError`` naming every problem."""
    problems = Problems()
    top = Section(document, "", problems)
    top.reject_unknown(TOP_LEVEL_KEYS)

    name = top.string(
        "name",
        required=True,
        pattern=JOB_NAME_PATTERN,
        pattern_hint="must be 1-100 characters of A-Z a-z 0-9 . _ -",
    )
    priority = top.integer("priority", 0, minimum=PRIORITY_MIN, maximum=PRIORITY_MAX)
    backend = top.string("backend", "sim", choices=BACKENDS)
    tick_seconds = top.number("tick_seconds", 1.0, above=0.0, maximum=MAX_TICK_SECONDS)

    model = _read_model(top.mapping("model", required=True))
    workload: WorkloadSpec | None = WorkloadSpec()
    if top.has("workload"):
        workload_section = top.mapping("workload")
        workload = _read_workload(workload_section) if workload_section is not None else None
    policy_name: str | None = DEFAULT_POLICY
    policy_params: dict[str, Any] | None = {}
    if top.has("policy"):
        policy_section = top.mapping("policy")
        policy_name, policy_params = (
            _read_policy(policy_section) if policy_section is not None else (None, None)
        )
    drafts = _read_components(top, cluster_gpus)
    runtime_ok, runtime = read_runtime(top, backend=backend, workload=workload, drafts=drafts)

    check_components(
        drafts, policy_name=policy_name, cluster_gpus=cluster_gpus, problems=problems, paths=_DynarlPaths()
    )
    check_policy(
        policy_name,
        policy_params,
        model_params_b=model.params_b if model is not None else None,
        problems=problems,
        name_path="policy.name",
        param_path=lambda param: f"policy.params.{param}",
        params_path="policy.params",
    )
    problems.raise_if_any()
    assert runtime_ok
    assert name is not None and priority is not None and backend is not None and tick_seconds is not None
    assert (
        model is not None and workload is not None and policy_name is not None and policy_params is not None
    )
    return JobSpec(
        name=name,
        priority=priority,
        backend=backend,
        model=model,
        workload=workload,
        components=tuple(d.build() for d in drafts),
        policy=PolicySpec(name=policy_name, params=policy_params),
        tick_seconds=tick_seconds,
        source_format="dynarl",
        runtime=runtime,
    )


def _read_model(section: Section | None) -> ModelSpec | None:
    if section is None:
        return None
    section.reject_unknown(MODEL_KEYS)
    name = section.string("name", required=True, max_length=200)
    params_b = section.number("params_b", required=True, above=0.0)
    if name is None or params_b is None:
        return None
    return ModelSpec(name=name, params_b=params_b)


def _read_workload(section: Section) -> WorkloadSpec | None:
    section.reject_unknown(WORKLOAD_KEYS)
    kind = section.string("kind", "math", choices=WORKLOAD_KINDS)
    iterations = section.integer("iterations", 10, minimum=1)
    prompts = section.integer("prompts_per_iteration", 512, minimum=1)
    samples = section.integer("samples_per_prompt", 8, minimum=1)
    max_new_tokens = section.integer("max_new_tokens", 8192, minimum=1)
    return read_workload(
        section,
        kind=kind,
        iterations=iterations,
        prompts_per_iteration=prompts,
        samples_per_prompt=samples,
        max_new_tokens=max_new_tokens,
        not_agentic="only applies when workload.kind is agentic (it is {kind!r})",
    )


def _read_policy(section: Section) -> tuple[str | None, dict[str, Any] | None]:
    section.reject_unknown(POLICY_KEYS)
    name = section.string("name", DEFAULT_POLICY)
    params_section = section.mapping("params")
    if params_section is None:
        return name, ({} if not section.has("params") else None)
    params: dict[str, Any] = {}
    keys_ok = True
    for key, value in params_section.data.items():
        if not isinstance(key, str):
            section.problems.add(params_section.path, f"parameter names must be strings, got {describe(key)}")
            keys_ok = False
        else:
            params[key] = value
    return name, params if keys_ok else None


def _read_components(top: Section, cluster_gpus: int | None) -> list[Draft]:
    items = top.sequence("components", required=True)
    if items is None:
        return []
    if not items:
        top.fail("components", "must list at least one component (an actor and a rollout)")
        return []
    drafts: list[Draft] = []
    for index, item in enumerate(items):
        path = f"components[{index}]"
        if not isinstance(item, Mapping):
            top.problems.add(path, f"must be a mapping, got {describe(item)}")
            continue
        drafts.append(_read_component(Section(item, path, top.problems), index, cluster_gpus))
    return drafts


def _read_component(section: Section, index: int, cluster_gpus: int | None) -> Draft:
    section.reject_unknown(COMPONENT_KEYS)
    name = section.string(
        "name",
        required=True,
        pattern=COMPONENT_NAME_PATTERN,
        pattern_hint="must start with a letter and have at most 64 characters of A-Z a-z 0-9 _ -",
    )
    kind_text = section.string("kind", required=True, choices=[k.value for k in ComponentKind])
    draft = Draft(index=index, name=name, kind=ComponentKind(kind_text) if kind_text is not None else None)

    parallelism = section.mapping("parallelism")
    if parallelism is not None:
        parallelism.reject_unknown(PARALLELISM_KEYS)
        draft.tp = parallelism.integer("tp", 1, minimum=1)
        draft.pp = parallelism.integer("pp", 1, minimum=1)
        draft.valid_dp = _read_valid_dp(parallelism)
    elif section.has("parallelism"):
        draft.tp = draft.pp = None
        draft.valid_dp = None

    has_workers, has_placement = section.has("workers"), section.has("placement")
    if has_workers and has_placement:
        section.problems.add(
            section.path, "workers and placement are mutually exclusive; give a count or explicit GPU ranks"
        )
        draft.count_ok = False
    elif not has_workers and not has_placement:
        section.problems.add(section.path, 'needs workers (a count) or placement (GPU ranks such as "0-3")')
        draft.count_ok = False
    elif has_workers:
        draft.workers = section.integer("workers", minimum=1)
        draft.count_ok = draft.workers is not None
    else:
        draft.uses_placement = True
        try:
            draft.placement = parse_gpu_ranks(section.raw("placement"), cluster_gpus)
        except RankError as exc:
            section.fail("placement", str(exc))
            draft.count_ok = False

    draft.min_workers = section.integer("min_workers", 1, minimum=0)
    draft.max_workers = section.integer("max_workers", None, nullable=True, minimum=1)
    draft.max_workers_ok = (
        not section.has("max_workers")
        or section.raw("max_workers") is None
        or (draft.max_workers is not None)
    )
    draft.hardware = _strings(section.string_list("hardware"))
    depends_on = section.string_list("depends_on")
    draft.depends_on = depends_on or ()
    colocated_with = section.string_list("colocated_with")
    draft.colocated_with = colocated_with or ()
    return draft


def _read_valid_dp(section: Section) -> tuple[int, ...] | None:
    items = section.sequence("valid_dp")
    if items is None:
        return None if section.has("valid_dp") else ()
    sizes: set[int] = set()
    ok = True
    for position, item in enumerate(items):
        path = f"{section.path_of('valid_dp')}[{position}]"
        if not is_int(item) or not 1 <= item <= INTEGER_MAX:
            section.problems.add(
                path, f"must be a positive integer up to {INTEGER_MAX}, got {describe(item)}"
            )
            ok = False
        elif item in sizes:
            section.problems.add(path, f"{item} is listed twice")
            ok = False
        else:
            sizes.add(item)
    return tuple(sorted(sizes)) if ok else None


def _strings(entries: tuple[tuple[int, str], ...] | None) -> tuple[str, ...] | None:
    return None if entries is None else tuple(value for _, value in entries)
