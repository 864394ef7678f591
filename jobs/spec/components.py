"""Components: the draft of a component as far as it parsed, and the checks across all of a spec's
components (names, worker counts, references, dependency cycles, shared GPUs, kinds, cluster size),
each reported where the source format lets it be fixed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from jobs.spec.errors import Problems
from jobs.spec.model import COLOCATED_POLICY, ComponentSpec
from jobs.spec.ranks import format_gpu_ranks
from jobs.spec.values import shown, suggestion
from scheduler.core.hypergraph import ComponentKind


@dataclass
class Draft:
    """A component as far as it parsed. ``None`` marks a field whose problem is already reported."""

    index: int
    name: str | None
    kind: ComponentKind | None
    tp: int | None = 1
    pp: int | None = 1
    valid_dp: tuple[int, ...] | None = ()
    workers: int | None = None
    placement: tuple[int, ...] | None = None
    uses_placement: bool = False  # placement (not workers) was given
    count_ok: bool = True  # the worker count or placement parsed
    min_workers: int | None = 1
    max_workers: int | None = None
    max_workers_ok: bool = True
    hardware: tuple[str, ...] | None = ()
    depends_on: tuple[tuple[int, str], ...] = ()  # (position in the list, name)
    colocated_with: tuple[tuple[int, str], ...] = ()

    @property
    def gpus_per_worker(self) -> int | None:
        return self.tp * self.pp if self.tp is not None and self.pp is not None else None

    @property
    def worker_count(self) -> int | None:
        if not self.count_ok:
            return None
        if not self.uses_placement:
            return self.workers
        per_worker = self.gpus_per_worker
        if self.placement is None or per_worker is None or len(self.placement) % per_worker:
            return None
        return len(self.placement) // per_worker

    def label(self) -> str:
        return f"component {self.name!r}" if self.name is not None else f"component #{self.index}"

    def build(self) -> ComponentSpec:
        """The final spec; only called once no problem at all was found."""
        assert self.name is not None and self.kind is not None
        assert self.tp is not None and self.pp is not None and self.valid_dp is not None
        assert self.min_workers is not None and self.hardware is not None
        return ComponentSpec(
            name=self.name,
            kind=self.kind,
            tp=self.tp,
            pp=self.pp,
            valid_dp=self.valid_dp,
            workers=None if self.uses_placement else self.workers,
            placement=self.placement if self.uses_placement else None,
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            hardware=self.hardware,
            depends_on=tuple(name for _, name in self.depends_on),
            colocated_with=tuple(name for _, name in self.colocated_with),
        )


class ComponentPaths(Protocol):
    """Where a component's fields live in the source document, for error paths."""

    def components(self) -> str: ...

    def field(self, draft: Draft, name: str) -> str: ...


def check_components(
    drafts: Sequence[Draft],
    *,
    policy_name: str | None,
    cluster_gpus: int | None,
    problems: Problems,
    paths: ComponentPaths,
) -> None:
    """Cross-field checks over all components; each problem is reported where it can be fixed."""
    by_name: dict[str, Draft] = {}
    for draft in drafts:
        if draft.name is None:
            continue
        if draft.name in by_name:
            first = by_name[draft.name]
            problems.add(
                paths.field(draft, "name"),
                f"duplicate component name {draft.name!r} (first used at {paths.field(first, 'name')})",
            )
        else:
            by_name[draft.name] = draft

    for draft in drafts:
        _check_worker_count(draft, problems, paths)
        _check_references(draft, by_name, problems, paths)

    _check_dependency_cycles(drafts, by_name, problems, paths)
    _check_shared_gpus(drafts, policy_name, problems, paths)
    _check_kinds(drafts, problems, paths)

    if cluster_gpus is not None and all(d.count_ok and d.gpus_per_worker is not None for d in drafts):
        placed: set[int] = set()
        counted = 0
        for draft in drafts:
            if draft.uses_placement and draft.placement is not None:
                placed.update(draft.placement)
            elif draft.workers is not None and draft.gpus_per_worker is not None:
                counted += draft.workers * draft.gpus_per_worker
        needed = len(placed) + counted
        if needed > cluster_gpus:
            problems.add(
                paths.components(), f"the job needs {needed} GPUs at start; the cluster has {cluster_gpus}"
            )


def _check_worker_count(draft: Draft, problems: Problems, paths: ComponentPaths) -> None:
    count_path = paths.field(draft, "count")
    per_worker = draft.gpus_per_worker
    if (
        draft.uses_placement
        and draft.placement is not None
        and per_worker
        and len(draft.placement) % per_worker
    ):
        problems.add(
            count_path,
            f"{len(draft.placement)} GPUs ({format_gpu_ranks(draft.placement)}) are not a whole number of "
            f"workers of tp x pp = {per_worker} GPUs",
        )
        return
    count = draft.worker_count
    if (
        draft.min_workers is not None
        and draft.max_workers is not None
        and draft.min_workers > draft.max_workers
    ):
        problems.add(
            paths.field(draft, "max_workers"),
            f"must be at least min_workers ({draft.min_workers}), got {draft.max_workers}",
        )
        return
    if count is None:
        return
    if draft.min_workers is not None and count < draft.min_workers:
        problems.add(count_path, f"{count} workers is below min_workers ({draft.min_workers})")
    if draft.max_workers_ok and draft.max_workers is not None and count > draft.max_workers:
        problems.add(count_path, f"{count} workers is above max_workers ({draft.max_workers})")
    if draft.valid_dp and count not in draft.valid_dp:
        allowed = ", ".join(str(n) for n in draft.valid_dp)
        problems.add(count_path, f"{count} workers is not one of parallelism.valid_dp ({allowed})")


def _check_references(
    draft: Draft, by_name: Mapping[str, Draft], problems: Problems, paths: ComponentPaths
) -> None:
    for position, name in draft.depends_on:
        path = f"{paths.field(draft, 'depends_on')}[{position}]"
        if name == draft.name:
            problems.add(path, "a component cannot depend on itself")
        elif name not in by_name:
            problems.add(path, f"unknown component {shown(name)}{suggestion(name, by_name)}")
    if not draft.colocated_with:
        return
    if not draft.uses_placement:
        problems.add(
            paths.field(draft, "colocated_with"),
            "needs an explicit placement (GPU ranks) to share; a worker count lets admission choose devices",
        )
        return
    for position, name in draft.colocated_with:
        path = f"{paths.field(draft, 'colocated_with')}[{position}]"
        other = by_name.get(name)
        if name == draft.name:
            problems.add(path, "a component cannot be colocated with itself")
        elif other is None:
            problems.add(path, f"unknown component {shown(name)}{suggestion(name, by_name)}")
        elif not other.uses_placement:
            problems.add(
                path, f"component {shown(name)} has a worker count, not an explicit placement to share"
            )
        elif (
            draft.placement is not None
            and other.placement is not None
            and not set(draft.placement) & set(other.placement)
        ):
            problems.add(
                path,
                f"shares no GPU with component {shown(name)}; colocated components share placement ranks",
            )


def _check_dependency_cycles(
    drafts: Sequence[Draft], by_name: Mapping[str, Draft], problems: Problems, paths: ComponentPaths
) -> None:
    edges = {
        name: [dep for _, dep in draft.depends_on if dep in by_name and dep != name]
        for name, draft in by_name.items()
    }
    done: set[str] = set()
    reported: set[frozenset[str]] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = [*trail[trail.index(name) :], name]
            members = frozenset(cycle)
            if members not in reported:
                reported.add(members)
                problems.add(
                    paths.field(by_name[cycle[0]], "depends_on"), "dependency cycle: " + " -> ".join(cycle)
                )
            return
        if name in done:
            return
        trail.append(name)
        for dep in edges[name]:
            visit(dep, trail)
        trail.pop()
        done.add(name)

    for draft in drafts:
        if draft.name is not None and by_name.get(draft.name) is draft:
            visit(draft.name, [])


def _check_shared_gpus(
    drafts: Sequence[Draft],
    policy_name: str | None,
    problems: Problems,
    paths: ComponentPaths,
) -> None:
    placed = [d for d in drafts if d.uses_placement and d.placement is not None and d.name is not None]
    for later_index, later in enumerate(placed):
        for earlier in placed[:later_index]:
            assert later.placement is not None and earlier.placement is not None
            shared = set(later.placement) & set(earlier.placement)
            if not shared or policy_name == COLOCATED_POLICY:
                continue
            marked = any(name == earlier.name for _, name in later.colocated_with) or any(
                name == later.name for _, name in earlier.colocated_with
            )
            if not marked:
                problems.add(
                    paths.field(later, "placement"),
                    f"shares GPUs {format_gpu_ranks(shared)} with {earlier.label()}; components may share GPUs "
                    f"only under policy {COLOCATED_POLICY} or when one lists the other in colocated_with",
                )


def _check_kinds(drafts: Sequence[Draft], problems: Problems, paths: ComponentPaths) -> None:
    if not drafts or any(d.kind is None for d in drafts):
        return  # a component whose kind is unreadable might be the missing one
    actors = [d for d in drafts if d.kind is ComponentKind.ACTOR]
    if len(actors) != 1:
        names = f" ({', '.join(repr(d.name) for d in actors)})" if actors else ""
        problems.add(paths.components(), f"needs exactly one actor component, found {len(actors)}{names}")
    if not any(d.kind is ComponentKind.ROLLOUT for d in drafts):
        problems.add(paths.components(), "needs at least one rollout component")
