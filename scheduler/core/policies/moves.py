"""Helpers shared by the policies: feasible moves, costs, cooldowns, loans and pending moves.

A move takes whole workers from a donor (a worker has tp * pp GPUs and leaves as a unit) or
devices from the free pool, and must leave both sides at valid worker counts (min/max workers and
``Parallelism.valid_dp``), land on hardware the recipient accepts, and form whole recipient workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Candidate, Decision, Reason
from scheduler.core.hypergraph import (
    Device,
    Hypergraph,
    HyperNode,
    Interruptibility,
    MigrationStrategy,
    Worker,
)


def movable_at_runtime(node: HyperNode) -> bool:
    """Whether the group may be resized while an iteration runs."""
    return node.interruptibility in (Interruptibility.ANY_REQUEST, Interruptibility.MICROBATCH)


def movable_between_iterations(node: HyperNode) -> bool:
    return node.interruptibility is not Interruptibility.NEVER


def worker_count(node: HyperNode) -> int:
    return len(node.workers)


def device_ids_of(workers: Iterable[Worker]) -> tuple[str, ...]:
    return tuple(d.id for w in workers for d in w.devices)


def devices_of(workers: Iterable[Worker]) -> tuple[Device, ...]:
    return tuple(d for w in workers for d in w.devices)


def release_problem(donor: HyperNode, workers_leaving: int) -> str | None:
    """Why the donor cannot give up ``workers_leaving`` workers, or None if it can."""
    remaining = worker_count(donor) - workers_leaving
    if workers_leaving <= 0 or remaining < 0:
        return f"{donor.id} has {worker_count(donor)} workers, cannot release {workers_leaving}"
    if remaining < donor.min_workers:
        return f"{donor.id} would drop to {remaining} workers, under its minimum {donor.min_workers}"
    if not donor.parallelism.is_valid_worker_count(remaining):
        return f"{donor.id} cannot run {remaining} workers (valid: {list(donor.parallelism.valid_dp)})"
    return None


def receive_problem(recipient: HyperNode, devices: Sequence[Device]) -> str | None:
    """Why the recipient cannot take ``devices`` as new workers, or None if it can."""
    gpus_per_worker = recipient.parallelism.gpus_per_worker
    if not devices:
        return "no devices to move"
    if len(devices) % gpus_per_worker:
        return f"{len(devices)} GPUs do not form whole {recipient.id} workers of {gpus_per_worker} GPUs"
    refused = sorted({d.hardware for d in devices if not recipient.accepts_hardware(d.hardware)})
    if refused:
        return f"{recipient.id} does not run on {', '.join(refused)}"
    per_node: dict[str, int] = {}
    for device in devices:
        per_node[device.node] = per_node.get(device.node, 0) + 1
    split = sorted(node for node, count in per_node.items() if count % gpus_per_worker)
    if split:
        # A tensor/pipeline-parallel worker keeps its GPUs on one host.
        return f"GPUs on {', '.join(split)} do not form whole {recipient.id} workers of {gpus_per_worker} on one node"
    after = worker_count(recipient) + len(devices) // gpus_per_worker
    if recipient.max_workers is not None and after > recipient.max_workers:
        return f"{recipient.id} would grow to {after} workers, over its maximum {recipient.max_workers}"
    if after < recipient.min_workers:
        return f"{recipient.id} would have {after} workers, under its minimum {recipient.min_workers}"
    if not recipient.parallelism.is_valid_worker_count(after):
        return f"{recipient.id} cannot run {after} workers (valid: {list(recipient.parallelism.valid_dp)})"
    return None


def valid_growth_steps(recipient: HyperNode, max_gpus: int) -> list[int]:
    """GPU amounts (ascending) the recipient can grow by within ``max_gpus`` and stay valid."""
    gpus_per_worker = recipient.parallelism.gpus_per_worker
    steps = []
    for extra_workers in range(1, max_gpus // gpus_per_worker + 1):
        after = worker_count(recipient) + extra_workers
        if recipient.max_workers is not None and after > recipient.max_workers:
            break
        if after >= recipient.min_workers and recipient.parallelism.is_valid_worker_count(after):
            steps.append(extra_workers * gpus_per_worker)
    return steps


def pick_free_devices(recipient: HyperNode, free: Sequence[Device], gpus: int) -> tuple[Device, ...] | None:
    """``gpus`` free devices the recipient accepts, a worker's worth per node where possible
    (tensor parallelism wants its GPUs on one host); None when not enough are acceptable."""
    gpus_per_worker = recipient.parallelism.gpus_per_worker
    acceptable = [d for d in free if recipient.accepts_hardware(d.hardware)]
    # Preferred hardware first, then fuller nodes, so workers stay within one host.
    rank = {hw: i for i, hw in enumerate(recipient.hardware_affinity)}
    by_node: dict[str, list[Device]] = {}
    for device in sorted(acceptable, key=lambda d: (rank.get(d.hardware, 0), d.node, d.id)):
        by_node.setdefault(device.node, []).append(device)
    chosen: list[Device] = []
    leftovers: list[Device] = []
    for node_devices in sorted(by_node.values(), key=lambda ds: (rank.get(ds[0].hardware, 0), -len(ds))):
        whole = len(node_devices) - len(node_devices) % gpus_per_worker
        chosen.extend(node_devices[:whole])
        leftovers.extend(node_devices[whole:])
    chosen.extend(leftovers)
    if len(chosen) < gpus:
        return None
    return tuple(chosen[:gpus])


def migration_cost_s(
    cost_model: MigrationCostModel,
    donor: HyperNode | None,
    recipient: HyperNode | None,
    gpus: int,
    *,
    requests_taken_back: int = 0,
    donor_gpus: int | None = None,
    recipient_gpus: int | None = None,
) -> float:
    """Seconds from decision to switch: the donor lets go, then the recipient takes the GPUs up.
    ``donor_gpus`` / ``recipient_gpus`` spare recounting the groups' GPUs in hot loops."""
    if gpus <= 0:
        return 0.0
    total = 0.0
    if donor is not None:
        held = donor.gpus if donor_gpus is None else donor_gpus
        total += cost_model.estimate_s(
            donor.strategy,
            gpus_moved=gpus,
            recipient_gpus_after=max(held - gpus, 1),
            requests_taken_back=requests_taken_back,
        )
    if recipient is not None:
        if recipient.strategy is MigrationStrategy.WORKLOAD:
            total += cost_model.engine_launch_s()
        else:
            held = recipient.gpus if recipient_gpus is None else recipient_gpus
            total += cost_model.estimate_s(
                recipient.strategy, gpus_moved=gpus, recipient_gpus_after=held + gpus
            )
    return total


def make_decision(
    policy: str,
    reason: Reason,
    detail: str,
    *,
    donor: HyperNode | None,
    recipient: HyperNode | None,
    device_ids: Sequence[str],
    at: float,
    chosen: Candidate | None = None,
    candidates: Sequence[Candidate] = (),
) -> Decision:
    return Decision(
        policy=policy,
        reason=reason,
        detail=detail,
        donor=donor.id if donor else None,
        recipient=recipient.id if recipient else None,
        device_ids=tuple(device_ids),
        donor_strategy=donor.strategy if donor else None,
        recipient_strategy=recipient.strategy if recipient else None,
        chosen=chosen,
        candidates=tuple(candidates),
        at=at,
    )


def apply_move(
    graph: Hypergraph, donor_id: str | None, recipient_id: str | None, devices: Sequence[Device]
) -> Hypergraph:
    """The graph as it will be once a move lands (used to chain several decisions in one tick).

    Donor workers holding the devices leave; the recipient gains workers of its tp * pp size.
    """
    moved = {d.id for d in devices}
    if donor_id is not None:
        donor = graph.node(donor_id)
        graph = graph.with_node(
            donor.with_workers(w for w in donor.workers if not any(d.id in moved for d in w.devices))
        )
    if recipient_id is not None:
        recipient = graph.node(recipient_id)
        size = recipient.parallelism.gpus_per_worker
        new_workers = [
            Worker(id=f"{recipient_id}+{devices[i].id}", devices=tuple(devices[i : i + size]))
            for i in range(0, len(devices) - len(devices) % size, size)
        ]
        graph = graph.with_node(recipient.with_workers((*recipient.workers, *new_workers)))
    return graph


class Cooldowns:
    """No new move touching a group until ``cooldown_s`` after its last one (anti-thrashing)."""

    def __init__(self, cooldown_s: float) -> None:
        self.cooldown_s = cooldown_s
        self._last_move_at: dict[str, float] = {}

    def remaining_s(self, group_id: str, now: float) -> float:
        last = self._last_move_at.get(group_id)
        if last is None:
            return 0.0
        return max(0.0, last + self.cooldown_s - now)

    def ready(self, group_id: str, now: float) -> bool:
        return self.remaining_s(group_id, now) <= 0.0

    def mark(self, group_ids: Iterable[str | None], now: float) -> None:
        for group_id in group_ids:
            if group_id is not None:
                self._last_move_at[group_id] = now

    def to_json(self) -> dict[str, float]:
        return dict(self._last_move_at)

    def load(self, data: Mapping[str, float]) -> None:
        self._last_move_at = {k: float(v) for k, v in data.items()}


@dataclass(frozen=True)
class Loan:
    """GPUs a group lent to another and expects back."""

    lender: str
    borrower: str
    device_ids: tuple[str, ...]
    at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "lender": self.lender,
            "borrower": self.borrower,
            "device_ids": list(self.device_ids),
            "at": self.at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Loan:
        return cls(
            lender=data["lender"],
            borrower=data["borrower"],
            device_ids=tuple(data["device_ids"]),
            at=float(data["at"]),
        )


@dataclass(frozen=True)
class ReturnMove:
    borrower: HyperNode
    lender: HyperNode
    workers: tuple[Worker, ...]

    @property
    def devices(self) -> tuple[Device, ...]:
        return devices_of(self.workers)


class LoanBook:
    """Outstanding loans, so borrowed GPUs go back to the group that owns them."""

    def __init__(self) -> None:
        self.loans: list[Loan] = []

    def lend(self, lender: str, borrower: str, device_ids: Sequence[str], at: float) -> None:
        self.loans.append(Loan(lender=lender, borrower=borrower, device_ids=tuple(device_ids), at=at))

    def pass_on(self, donor: str, recipient: str, device_ids: Sequence[str], at: float) -> None:
        """``donor`` gives ``device_ids`` to ``recipient``: devices it had borrowed stay owed to
        their lender (now by the recipient, or settled if the recipient is that lender); its own
        devices become a new loan from it."""
        moved = set(device_ids)
        carried: set[str] = set()
        kept: list[Loan] = []
        for loan in self.loans:
            passing = tuple(d for d in loan.device_ids if d in moved) if loan.borrower == donor else ()
            if not passing:
                kept.append(loan)
                continue
            carried.update(passing)
            staying = tuple(d for d in loan.device_ids if d not in moved)
            if staying:
                kept.append(Loan(loan.lender, loan.borrower, staying, loan.at))
            if loan.lender != recipient:
                kept.append(Loan(loan.lender, recipient, passing, loan.at))
        own = tuple(d for d in device_ids if d not in carried)
        if own:
            kept.append(Loan(donor, recipient, own, at))
        self.loans = kept

    def outstanding(self, *, lender: str | None = None, borrower: str | None = None) -> list[Loan]:
        return [
            loan
            for loan in self.loans
            if (lender is None or loan.lender == lender) and (borrower is None or loan.borrower == borrower)
        ]

    def borrowed_gpus(self, borrower: str) -> int:
        return sum(len(loan.device_ids) for loan in self.outstanding(borrower=borrower))

    def settle(self, lender: str, borrower: str, device_ids: Sequence[str]) -> None:
        """``borrower`` gave ``device_ids`` back to ``lender``. Loaned devices among them are
        settled; any others (whole workers mixing loaned and own GPUs) settle as many further
        loaned GPUs, since the lender got that many back."""
        returned = set(device_ids)
        extra = len(returned)
        remaining: list[Loan] = []
        for loan in self.loans:
            if loan.lender == lender and loan.borrower == borrower:
                extra -= sum(d in returned for d in loan.device_ids)
        for loan in self.loans:
            if loan.lender != lender or loan.borrower != borrower:
                remaining.append(loan)
                continue
            keep = tuple(d for d in loan.device_ids if d not in returned)
            if extra > 0:
                dropped = min(extra, len(keep))
                keep, extra = keep[dropped:], extra - dropped
            if keep:
                remaining.append(Loan(loan.lender, loan.borrower, keep, loan.at))
        self.loans = remaining

    def lenders_of(self, lenders: Iterable[str]) -> dict[str, str]:
        """Devices currently owed to any of ``lenders``, each to its lender."""
        wanted = set(lenders)
        return {d: loan.lender for loan in self.loans if loan.lender in wanted for d in loan.device_ids}

    def reconcile(self, graph: Hypergraph, in_flight: set[str]) -> None:
        """Keep only loaned devices the borrower holds or that are still on their way to it; the
        rest never arrived (the move failed or was rolled back) or came back another way."""
        held: dict[str, str] = {d: n.id for n in graph.nodes for d in n.device_ids}
        kept: list[Loan] = []
        for loan in self.loans:
            ids = tuple(d for d in loan.device_ids if d in in_flight or held.get(d) == loan.borrower)
            if ids:
                kept.append(Loan(loan.lender, loan.borrower, ids, loan.at))
        self.loans = kept

    def return_moves(
        self,
        graph: Hypergraph,
        *,
        lender: str | None = None,
        borrower: str | None = None,
        keep_a_worker: bool = False,
    ) -> list[ReturnMove]:
        """Whole borrower workers worth the loaned GPUs, per (borrower, lender), each move valid
        on the graph left by the ones before it. The book is not changed (see ``settle``).

        ``keep_a_worker``: no borrower gives up its last worker, whatever its minimum. At an
        iteration boundary every group has the next iteration's work ahead; a group that lent
        all its own GPUs on and holds only borrowed ones keeps one of them, still owed, since
        its own come back only once their return has landed."""
        # Workers each borrower may give back: those it holds now, less one to keep. (The graph
        # below is the one left by the moves before, whose incoming workers are not there yet.)
        spare: dict[str, int] | None = (
            {n.id: worker_count(n) - 1 for n in graph.nodes} if keep_a_worker else None
        )
        moves: list[ReturnMove] = []
        loans = self.outstanding(lender=lender, borrower=borrower)
        pairs = []
        for borrower_id, lender_id in {(loan.borrower, loan.lender) for loan in loans}:
            try:
                lender_node = graph.node(lender_id)
                loaned = {
                    d
                    for loan in self.outstanding(lender=lender_id, borrower=borrower_id)
                    for d in loan.device_ids
                }
                owed = len(loaned & set(graph.node(borrower_id).device_ids))
            except KeyError:
                continue
            if owed:
                pairs.append((bool(lender_node.workers), -owed, borrower_id, lender_id, loaned))
        # Lenders left without workers first (they cannot run at all), then the most owed: a
        # borrower whose valid sizes are far apart (a trainer's powers of two) may only manage
        # a valid return for the larger debts first.
        # Passes until nothing more can go back: a return to one lender may bring the borrower to
        # a size from which another valid return opens up.
        progressed = True
        while progressed:
            progressed = False
            for _, _, borrower_id, lender_id, loaned in sorted(pairs, key=lambda p: p[:4]):
                move = self._return_move(
                    graph, borrower_id, lender_id, loaned, None if spare is None else spare[borrower_id]
                )
                if move is not None:
                    if spare is not None:
                        spare[borrower_id] -= len(move.workers)
                    moves.append(move)
                    graph = apply_move(graph, borrower_id, lender_id, move.devices)
                    progressed = True
        # What is still owed goes back all at once when that leaves the borrower at a valid size
        # although no single return does (a trainer of 16 power-of-two ranks owing 4 to each of
        # two groups): it passes through an invalid size only while the returns are in flight.
        for borrower_id in sorted({p[2] for p in pairs}):
            together: list[ReturnMove] = []
            leaving = 0
            borrower_node = graph.node(borrower_id)
            for _, _, owner, lender_id, loaned in sorted(pairs, key=lambda p: p[:4]):
                if owner != borrower_id:
                    continue
                owed = len(loaned & set(borrower_node.device_ids))
                whole = [w for w in borrower_node.workers if all(d.id in loaned for d in w.devices)]
                workers = tuple(whole[: owed // max(1, borrower_node.parallelism.gpus_per_worker)])
                lender_node = graph.node(lender_id)
                if workers and receive_problem(lender_node, devices_of(workers)) is None:
                    together.append(ReturnMove(borrower=borrower_node, lender=lender_node, workers=workers))
                    leaving += len(workers)
            if (
                len(together) > 1
                and release_problem(borrower_node, leaving) is None
                and (spare is None or leaving <= spare[borrower_id])
            ):
                for move in together:
                    moves.append(move)
                    graph = apply_move(graph, borrower_id, move.lender.id, move.devices)
        return moves

    @staticmethod
    def _return_move(
        graph: Hypergraph,
        borrower_id: str,
        lender_id: str,
        loaned: set[str],
        spare_workers: int | None = None,
    ) -> ReturnMove | None:
        """The largest valid return of ``loaned`` devices the borrower still holds, or None; no
        more than ``spare_workers`` of its workers when given."""
        borrower_node = graph.node(borrower_id)
        lender_node = graph.node(lender_id)
        owed = len(loaned & set(borrower_node.device_ids))
        if spare_workers is not None:
            owed = min(owed, max(0, spare_workers) * borrower_node.parallelism.gpus_per_worker)
        if owed == 0:
            return None
        # Workers made of loaned devices go first, then mixed ones; never more GPUs than owed.
        holding = [w for w in borrower_node.workers if any(d.id in loaned for d in w.devices)]
        holding.sort(key=lambda w: (-sum(d.id in loaned for d in w.devices) / len(w.devices), w.id))
        workers = largest_valid_transfer(borrower_node, lender_node, holding, max_gpus=owed)
        return ReturnMove(borrower=borrower_node, lender=lender_node, workers=workers) if workers else None

    def to_json(self) -> list[dict[str, Any]]:
        return [loan.to_json() for loan in self.loans]

    def load(self, data: Sequence[Mapping[str, Any]]) -> None:
        self.loans = [Loan.from_json(item) for item in data]


def bundles(recipient: HyperNode, ordered_workers: Sequence[Worker]) -> list[tuple[Worker, ...]]:
    """Donor workers grouped, in order of preference, into the smallest same-node sets that make
    whole recipient workers (two 1-GPU engines for a tp=2 trainer rank group, say). A bundle is
    complete when it is; workers left in an incomplete bundle are not offered."""
    size = recipient.parallelism.gpus_per_worker
    open_bundles: dict[str, list[Worker]] = {}
    complete: list[tuple[Worker, ...]] = []
    for worker in ordered_workers:
        if not worker.devices:
            continue
        nodes = {d.node for d in worker.devices}
        if len(nodes) > 1:
            # A worker spanning hosts moves on its own, if each host's share makes whole workers.
            if all(sum(d.node == n for d in worker.devices) % size == 0 for n in nodes):
                complete.append((worker,))
            continue
        bundle = open_bundles.setdefault(worker.node, [])
        bundle.append(worker)
        if sum(len(w.devices) for w in bundle) % size == 0:
            complete.append(tuple(bundle))
            bundle.clear()
    return complete


def largest_valid_transfer(
    donor: HyperNode, recipient: HyperNode, ordered_workers: Sequence[Worker], *, max_gpus: int | None = None
) -> tuple[Worker, ...]:
    """The most of ``ordered_workers`` (whole bundles, in order) the donor can give and the
    recipient can take, within ``max_gpus``."""
    offered = bundles(recipient, ordered_workers)
    for count in range(len(offered), 0, -1):
        workers = tuple(w for bundle in offered[:count] for w in bundle)
        gpus = sum(len(w.devices) for w in workers)
        if max_gpus is not None and gpus > max_gpus:
            continue
        if (
            release_problem(donor, len(workers)) is None
            and receive_problem(recipient, devices_of(workers)) is None
        ):
            return workers
    return ()


@dataclass(frozen=True)
class PendingMove:
    donor: str | None
    recipient: str | None
    device_ids: tuple[str, ...]
    at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "donor": self.donor,
            "recipient": self.recipient,
            "device_ids": list(self.device_ids),
            "at": self.at,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PendingMove:
        return cls(
            donor=data["donor"],
            recipient=data["recipient"],
            device_ids=tuple(data["device_ids"]),
            at=float(data["at"]),
        )


class PendingMoves:
    """Decisions issued but not yet visible in the hypergraph.

    Migrations take seconds and ticks come every second; without this a policy would issue the
    same move again before the first one lands. A move is done once none of its devices is with
    the donor or in transit; after ``timeout_s`` it is presumed failed or rolled back.
    """

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.moves: list[PendingMove] = []

    def add(self, decision: Decision) -> None:
        self.moves.append(PendingMove(decision.donor, decision.recipient, decision.device_ids, decision.at))

    def discard(self, decision: Decision) -> None:
        """``decision`` will not be carried out: it is no longer awaited."""
        devices = tuple(decision.device_ids)
        self.moves = [
            m
            for m in self.moves
            if (m.donor, m.recipient, m.device_ids) != (decision.donor, decision.recipient, devices)
        ]

    def refresh(self, graph: Hypergraph, now: float, free_device_ids: Iterable[str] = ()) -> None:
        held: dict[str, str] = {d: n.id for n in graph.nodes for d in n.device_ids}
        free = set(free_device_ids)

        def landed(move: PendingMove) -> bool:
            # Landed once no device is still with the donor or in transit (held by nobody and
            # not free). The recipient may have left a device that made no whole worker free.
            return all(d in free or (d in held and held[d] != move.donor) for d in move.device_ids)

        self.moves = [m for m in self.moves if not landed(m) and now - m.at < self.timeout_s]

    def busy_groups(self) -> set[str]:
        return {g for m in self.moves for g in (m.donor, m.recipient) if g is not None}

    def device_ids(self) -> set[str]:
        return {d for m in self.moves for d in m.device_ids}

    def to_json(self) -> list[dict[str, Any]]:
        return [m.to_json() for m in self.moves]

    def load(self, data: Sequence[Mapping[str, Any]]) -> None:
        self.moves = [PendingMove.from_json(item) for item in data]


class IterationClock:
    """When the current iteration began (the first tick that saw its number)."""

    def __init__(self) -> None:
        self.iteration: int | None = None
        self.started_at = 0.0

    def observe(self, graph: Hypergraph, now: float) -> bool:
        """Returns True when ``graph`` starts a new iteration."""
        if graph.iteration != self.iteration:
            self.iteration = graph.iteration
            self.started_at = now
            return True
        return False

    def elapsed_s(self, now: float) -> float:
        return max(0.0, now - self.started_at)

    def to_json(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "started_at": self.started_at}

    def load(self, data: Mapping[str, Any]) -> None:
        iteration = data.get("iteration")
        self.iteration = None if iteration is None else int(iteration)
        self.started_at = float(data.get("started_at", 0.0))
