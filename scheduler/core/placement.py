"""Gang placement: put every worker of every group of a job onto free devices, or none at all.

A worker needs ``gpus_per_worker`` devices on one node (tensor/pipeline parallel ranks talk over
NVLink), of a hardware type its group accepts. Explicit placements name global ranks: devices
numbered across the cluster in (node name, device index) order, as RLinf numbers them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.core.hypergraph import Device, largest_worker_count


@dataclass(frozen=True)
class GroupRequest:
    name: str
    workers: int
    gpus_per_worker: int
    hardware: tuple[str, ...] = ()  # accepted types, best first; empty = any
    ranks: tuple[int, ...] | None = None  # explicit global ranks instead of a count

    @property
    def gpus(self) -> int:
        return len(self.ranks) if self.ranks is not None else self.workers * self.gpus_per_worker

    def accepts(self, hardware: str) -> bool:
        return not self.hardware or hardware in self.hardware


@dataclass(frozen=True)
class PlacementFailure:
    group: str
    reason: str


Placement = dict[str, list[tuple[Device, ...]]]  # group -> one device tuple per worker


def global_rank_order(devices: Sequence[Device]) -> list[Device]:
    return sorted(devices, key=lambda d: (d.node, d.index))


def place(
    groups: Sequence[GroupRequest], free: Sequence[Device], cluster: Sequence[Device]
) -> Placement | PlacementFailure:
    """Place all groups on ``free`` (a subset of ``cluster``) or report the first group that cannot fit.

    Explicit ranks are resolved against the whole cluster's rank order, so a rank held by another
    job makes the placement wait rather than shift. Groups sharing ranks are colocated and share
    those devices.
    """
    free_ids = {d.id for d in free}
    ordered_cluster = global_rank_order(cluster)
    placement: Placement = {}
    taken: set[str] = set()

    for group in groups:
        if group.ranks is None:
            continue
        workers: list[tuple[Device, ...]] = []
        chosen: list[Device] = []
        for rank in group.ranks:
            if rank >= len(ordered_cluster):
                return PlacementFailure(
                    group.name, f"rank {rank} is beyond the cluster's {len(ordered_cluster)} GPUs"
                )
            device = ordered_cluster[rank]
            if device.id not in free_ids:
                return PlacementFailure(group.name, f"rank {rank} ({device.id}) is not free")
            if not group.accepts(device.hardware):
                return PlacementFailure(
                    group.name, f"rank {rank} is {device.hardware}, not {'/'.join(group.hardware)}"
                )
            chosen.append(device)
        for start in range(0, len(chosen), group.gpus_per_worker):
            workers.append(tuple(chosen[start : start + group.gpus_per_worker]))
        placement[group.name] = workers
        taken.update(d.id for d in chosen)

    by_node: dict[str, list[Device]] = defaultdict(list)
    for device in global_rank_order(free):
        if device.id not in taken:
            by_node[device.node].append(device)

    # Largest groups first: they are the hardest to fit.
    counted = sorted((g for g in groups if g.ranks is None), key=lambda g: (-g.gpus_per_worker, -g.gpus))
    for group in counted:
        workers = []
        for _ in range(group.workers):
            worker = _take_worker(by_node, group)
            if worker is None:
                return PlacementFailure(
                    group.name,
                    f"needs {group.workers} worker(s) of {group.gpus_per_worker} GPU(s)"
                    + (f" on {'/'.join(group.hardware)}" if group.hardware else "")
                    + f"; only {len(workers)} fit on the free devices",
                )
            workers.append(worker)
        placement[group.name] = workers
    return placement


def _take_worker(by_node: dict[str, list[Device]], group: GroupRequest) -> tuple[Device, ...] | None:
    """Take ``gpus_per_worker`` devices from one node: best hardware first, then the node with the
    fewest suitable free devices that still fit (best fit keeps big holes for big workers)."""
    preference = {hw: i for i, hw in enumerate(group.hardware)}
    best: tuple[tuple[int, int, str], list[Device]] | None = None
    for node, devices in by_node.items():
        suitable = [d for d in devices if group.accepts(d.hardware)]
        if not suitable:
            continue
        by_hw: dict[str, list[Device]] = defaultdict(list)
        for d in suitable:
            by_hw[d.hardware].append(d)
        for hardware, same in by_hw.items():
            if len(same) < group.gpus_per_worker:
                continue
            key = (preference.get(hardware, len(preference)), len(same), node)
            if best is None or key < best[0]:
                best = (key, same[: group.gpus_per_worker])
    if best is None:
        return None
    chosen = best[1]
    node = chosen[0].node
    chosen_ids = {d.id for d in chosen}
    by_node[node] = [d for d in by_node[node] if d.id not in chosen_ids]
    return tuple(chosen)


def fits_in(groups: Sequence[GroupRequest], cluster: Sequence[Device]) -> PlacementFailure | None:
    """Could the job ever be placed on this cluster if it were empty? None when it could."""
    result = place(groups, cluster, cluster)
    return result if isinstance(result, PlacementFailure) else None


@dataclass(frozen=True)
class GroupShape:
    """What a running job's GPU group allows when the job is placed anew: its worker size, limits
    and hardware, and the GPUs its spec gives it when the job runs disaggregated."""

    name: str
    gpus_per_worker: int
    min_workers: int
    max_workers: int | None
    valid_dp: tuple[int, ...]
    hardware: tuple[str, ...]
    split_gpus: int  # disaggregated: the spec's GPUs for this group
    # Colocated, a group whose stages time-share the GPUs (rollout, inference, the trainer)
    # spreads over as many as its limits allow; the others (reward, tools: workers that serve
    # calls) keep their spec's count, on the first devices.
    spreads: bool = True


def relayout(
    groups: Sequence[GroupShape], devices: Sequence[Device], *, time_shared: bool
) -> Placement | PlacementFailure:
    """The job's GPU groups placed anew on the devices the job holds: every group time-sharing
    them (colocated: as many as its largest worker count within its limits and valid
    data-parallel sizes allows, all of them where it can), or each on its own share in the
    spec's split (disaggregated). The groups' limits hold in either: a worker count outside
    [min, max] or the valid data-parallel sizes, or a worker that would span two nodes, is a
    failure naming the group."""
    ordered = global_rank_order(devices)
    requests: list[GroupRequest] = []
    for group in groups:
        ranks = _time_shared_ranks(group, ordered) if time_shared else None
        gpus = len(ranks) if ranks is not None else group.split_gpus
        if gpus <= 0 or gpus % group.gpus_per_worker:
            return PlacementFailure(
                group.name, f"{gpus} GPUs are not whole workers of {group.gpus_per_worker} GPU(s)"
            )
        workers = gpus // group.gpus_per_worker
        if workers < group.min_workers or (group.max_workers is not None and workers > group.max_workers):
            limit = (
                f"{group.min_workers}–{group.max_workers}" if group.max_workers else f"≥ {group.min_workers}"
            )
            return PlacementFailure(group.name, f"{workers} workers is outside its limits ({limit})")
        if group.valid_dp and workers not in group.valid_dp:
            return PlacementFailure(
                group.name, f"{workers} workers is not a valid data-parallel size {list(group.valid_dp)}"
            )
        requests.append(GroupRequest(group.name, workers, group.gpus_per_worker, group.hardware, ranks))
    if not time_shared and sum(r.gpus for r in requests) > len(ordered):
        return PlacementFailure(
            requests[0].name if requests else "",
            f"the spec's split needs more than the job's {len(ordered)} GPUs",
        )
    placed = place(requests, ordered, ordered)
    if isinstance(placed, PlacementFailure):
        return placed
    for name, placed_workers in placed.items():
        for worker in placed_workers:
            if len({d.node for d in worker}) > 1:
                return PlacementFailure(name, f"a worker would span nodes {sorted({d.node for d in worker})}")
    return placed


def _time_shared_ranks(group: GroupShape, ordered: Sequence[Device]) -> tuple[int, ...]:
    """The global ranks a time-sharing group spans: its largest acceptable worker count of
    whole workers within nodes (at most its spec's count for a group that does not spread), on
    the first nodes in rank order; every rank when none is acceptable (``relayout`` then names
    the limit)."""
    per_node: dict[str, list[int]] = defaultdict(list)
    for rank, device in enumerate(ordered):
        per_node[device.node].append(rank)
    fitting = sum(len(ranks) // group.gpus_per_worker for ranks in per_node.values())
    if not group.spreads:
        fitting = min(fitting, group.split_gpus // group.gpus_per_worker)
    workers = largest_worker_count(
        fitting, min_workers=group.min_workers, max_workers=group.max_workers, valid_dp=group.valid_dp
    )
    if not workers:
        return tuple(range(len(ordered)))
    chosen: list[int] = []
    for ranks in per_node.values():
        whole = min(len(ranks) // group.gpus_per_worker, workers - len(chosen) // group.gpus_per_worker)
        chosen.extend(ranks[: whole * group.gpus_per_worker])
    return tuple(chosen)
