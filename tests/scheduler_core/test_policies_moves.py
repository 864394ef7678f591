from scheduler.core.costs import MigrationCostModel
from scheduler.core.decisions import Reason
from scheduler.core.hypergraph import ComponentKind, Device, HyperNode, Parallelism, Worker
from scheduler.core.policies.moves import (
    LoanBook,
    PendingMoves,
    apply_move,
    bundles,
    largest_valid_transfer,
    make_decision,
    migration_cost_s,
    pick_free_devices,
    receive_problem,
    release_problem,
    valid_growth_steps,
)
from tests.scheduler_core.test_policies_fixtures import make_graph, make_group

ROLLOUT = ComponentKind.ROLLOUT
ACTOR = ComponentKind.ACTOR
INFERENCE = ComponentKind.INFERENCE


def test_release_and_receive_problems_name_the_constraint():
    rollout = make_group("rollout", ROLLOUT, 4, first_device=0, min_workers=2)
    actor = make_group(
        "actor", ACTOR, 2, first_device=10, gpus_per_worker=2, parallelism=Parallelism(tp=2, valid_dp=(2, 4))
    )
    assert release_problem(rollout, 2) is None
    assert "minimum" in (release_problem(rollout, 3) or "")
    three = [d for w in rollout.workers[:3] for d in w.devices]
    assert "whole" in (receive_problem(actor, three) or "")
    assert "cannot run 3 workers" in (receive_problem(actor, three[:2]) or "")
    four = [Device(f"x{i}", "n1", "H100") for i in range(4)]
    assert receive_problem(actor, four) is None
    assert valid_growth_steps(actor, 8) == [4]


def test_free_devices_are_picked_a_whole_worker_per_node_and_by_preferred_hardware():
    actor = make_group(
        "actor", ACTOR, 1, first_device=0, gpus_per_worker=2, hardware_affinity=("H800", "H100")
    )
    free = [
        Device("a0", "na", "H100"),
        Device("b0", "nb", "H100"),
        Device("b1", "nb", "H100"),
        Device("c0", "nc", "H800"),
        Device("c1", "nc", "H800"),
        Device("d0", "nd", "H20"),
    ]
    picked = pick_free_devices(actor, free, 4)
    assert picked is not None
    assert [d.id for d in picked] == ["c0", "c1", "b0", "b1"]
    assert pick_free_devices(actor, free, 6) is None  # the H20 is refused


def test_costs_add_the_donor_release_and_the_recipient_start():
    rollout = make_group("rollout", ROLLOUT, 4, first_device=0)
    actor = make_group("actor", ACTOR, 4, first_device=10)
    model = MigrationCostModel(model_params_b=7.0)
    cost = migration_cost_s(model, rollout, actor, 2, requests_taken_back=10)
    workload = model.workload_pause_s + 0.001 * 10
    p2p = model.p2p_fixed_s + model.trainer_state_gb / 6 / model.p2p_bandwidth_gb_s
    assert abs(cost - (workload + p2p)) < 1e-9
    assert migration_cost_s(model, actor, rollout, 2) > model.engine_launch_s()
    assert migration_cost_s(model, None, actor, 0) == 0.0


def test_loans_come_back_as_whole_valid_workers():
    graph = make_graph(
        make_group("rollout", ROLLOUT, 4, first_device=0),
        make_group("actor", ACTOR, 2, first_device=10),
    )
    book = LoanBook()
    lent = [d for w in graph.node("rollout").workers[:2] for d in w.devices]
    book.lend("rollout", "actor", [d.id for d in lent], at=0.0)
    graph = apply_move(graph, "rollout", "actor", lent)
    [move] = book.return_moves(graph)
    assert (move.borrower.id, move.lender.id) == ("actor", "rollout")
    assert {d.id for d in move.devices} == {d.id for d in lent}
    book.settle("rollout", "actor", [d.id for d in move.devices])
    assert book.loans == []


def test_settling_goes_by_device_and_then_by_count():
    book = LoanBook()
    book.lend("rollout", "actor", ["r1", "r2", "r3"], at=0.0)
    book.settle("rollout", "actor", ["r2"])
    assert book.outstanding()[0].device_ids == ("r1", "r3")
    book.settle("rollout", "actor", ["a9"])  # the actor's own GPU went back in a mixed worker
    assert book.outstanding()[0].device_ids == ("r3",)


def test_loans_forget_devices_that_never_reached_the_borrower():
    graph = make_graph(
        make_group("rollout", ROLLOUT, 4, first_device=0),
        make_group("actor", ACTOR, 2, first_device=10),
    )
    book = LoanBook()
    book.lend("rollout", "actor", ["n0-g0"], at=0.0)
    book.reconcile(graph, in_flight={"n0-g0"})
    assert book.outstanding(lender="rollout")  # still on its way
    book.reconcile(graph, in_flight=set())
    assert book.loans == []  # the move was rolled back: the rollout still holds it


def test_pending_moves_clear_once_landed_or_timed_out():
    graph = make_graph(
        make_group("rollout", ROLLOUT, 4, first_device=0),
        make_group("actor", ACTOR, 2, first_device=10),
    )
    pending = PendingMoves(timeout_s=30.0)
    rollout = graph.node("rollout")
    decision = make_decision(
        "dynarl",
        Reason.DONOR_LOW_UTILISATION,
        "test",
        donor=rollout,
        recipient=graph.node("actor"),
        device_ids=["n0-g0"],
        at=0.0,
    )
    pending.add(decision)
    pending.refresh(graph, now=1.0)
    assert pending.busy_groups() == {"rollout", "actor"}
    in_transit = graph.with_node(rollout.with_workers(rollout.workers[1:]))
    pending.refresh(in_transit, now=2.0)
    assert pending.busy_groups()  # neither with the donor nor anywhere: still moving
    landed = apply_move(graph, "rollout", "actor", list(rollout.workers[0].devices))
    pending.refresh(landed, now=3.0)
    assert pending.busy_groups() == set()
    pending.add(decision)
    pending.refresh(graph, now=40.0)
    assert pending.busy_groups() == set()  # presumed failed


def test_largest_valid_transfer_shrinks_until_both_sides_are_valid():
    donor = make_group("rollout", ROLLOUT, 6, first_device=0, min_workers=1)
    actor = make_group("actor", ACTOR, 2, first_device=10, parallelism=Parallelism(valid_dp=(2, 4, 8)))
    workers = largest_valid_transfer(donor, actor, list(donor.workers))
    assert len(workers) == 2  # 5 would leave 1 rollout worker but make 7 actor workers


def two_node_rollout() -> HyperNode:
    a = make_group("rollout", ROLLOUT, 3, first_device=0, node="na")
    b = make_group("rollout", ROLLOUT, 3, first_device=0, node="nb")
    renamed = [Worker(id=f"{w.id}-b", devices=w.devices) for w in b.workers]
    return a.with_workers((*a.workers, *renamed))


def test_bundles_pair_engines_on_one_node_for_a_wider_trainer_worker():
    rollout = two_node_rollout()
    actor = make_group("actor", ACTOR, 1, first_device=10, gpus_per_worker=2)
    by_id = {w.id: w for w in rollout.workers}
    order = [by_id[i] for i in ("rollout-w0", "rollout-w0-b", "rollout-w1", "rollout-w2", "rollout-w1-b")]
    offered = bundles(actor, order)
    assert [[w.id for w in bundle] for bundle in offered] == [
        ["rollout-w0", "rollout-w1"],
        ["rollout-w0-b", "rollout-w1-b"],
    ]
    split = [by_id["rollout-w0"].devices[0], by_id["rollout-w0-b"].devices[0]]
    assert "one node" in (receive_problem(actor, split) or "")


def test_passing_on_borrowed_gpus_keeps_them_owed_to_their_lender():
    book = LoanBook()
    book.lend("actor", "rollout", ["a1", "a2", "a3"], at=0.0)
    book.pass_on("rollout", "inference", ["a1", "a2", "r7"], at=5.0)
    owed = {(loan.lender, loan.borrower): set(loan.device_ids) for loan in book.loans}
    assert owed == {
        ("actor", "rollout"): {"a3"},
        ("actor", "inference"): {"a1", "a2"},
        ("rollout", "inference"): {"r7"},
    }
    book.pass_on("inference", "actor", ["a1"], at=6.0)  # back home: settled
    owed = {(loan.lender, loan.borrower): set(loan.device_ids) for loan in book.loans}
    assert owed[("actor", "inference")] == {"a2"}


def test_loans_come_back_largest_debt_first_and_in_passes_until_nothing_more_can():
    # A trainer of 16 ranks (powers of two only) owing 8 to the rollout and 4 to the log-prob
    # group: giving the 4 back first would leave 12 ranks, so the 8 go first (16 -> 8), then
    # the 4 (8 -> 4). Both groups gave everything (a synchronous job between batches).
    powers = Parallelism(valid_dp=(1, 2, 4, 8, 16))
    rollout = make_group("rollout", ROLLOUT, 8, first_device=0, min_workers=0)
    inference = make_group("inference", INFERENCE, 4, first_device=20, min_workers=0)
    graph = make_graph(rollout, inference, make_group("actor", ACTOR, 4, first_device=40, parallelism=powers))
    book = LoanBook()
    for lender in (rollout, inference):
        devices = [d for w in lender.workers for d in w.devices]
        book.lend(lender.id, "actor", [d.id for d in devices], at=0.0)
        graph = apply_move(graph, lender.id, "actor", devices)
    assert len(graph.node("actor").workers) == 16 and not graph.node("rollout").workers
    moves = book.return_moves(graph)
    assert [(m.lender.id, len(m.devices)) for m in moves] == [("rollout", 8), ("inference", 4)]
    for m in moves:
        graph = apply_move(graph, "actor", m.lender.id, m.devices)
    assert {n.id: len(n.workers) for n in graph.nodes} == {"rollout": 8, "inference": 4, "actor": 4}


def test_a_boundary_return_leaves_a_group_holding_only_borrowed_gpus_one_worker():
    # The log-prob group lent its own GPUs on to the trainer and computes on the rollout's:
    # at the boundary the trainer gives its GPUs back, but they land only after the log-prob
    # group's own returns have left; with nothing kept it would have no worker for the next
    # iteration's log-probs, which are due before its GPUs are back.
    rollout = make_group("rollout", ROLLOUT, 6, first_device=0, min_workers=0)
    inference = make_group("inference", INFERENCE, 2, first_device=20, min_workers=0)
    graph = make_graph(rollout, inference, make_group("actor", ACTOR, 1, first_device=40))
    book = LoanBook()
    own = [d for w in inference.workers for d in w.devices]
    borrowed = [d for w in rollout.workers[:3] for d in w.devices]
    book.lend("inference", "actor", [d.id for d in own], at=0.0)
    graph = apply_move(graph, "inference", "actor", own)
    book.lend("rollout", "inference", [d.id for d in borrowed], at=0.0)
    graph = apply_move(graph, "rollout", "inference", borrowed)
    assert set(graph.node("inference").device_ids) == {d.id for d in borrowed}

    everything = book.return_moves(graph)  # ticks' returns: the group may be done with its share
    assert sum(len(m.devices) for m in everything if m.borrower.id == "inference") == 3

    moves = book.return_moves(graph, keep_a_worker=True)
    back = {(m.borrower.id, m.lender.id): len(m.devices) for m in moves}
    assert back == {("inference", "rollout"): 2, ("actor", "inference"): 2}
    for m in moves:
        book.settle(m.lender.id, m.borrower.id, [d.id for d in m.devices])
    # The worker kept stays owed, to go home once the log-prob group can spare it.
    assert book.borrowed_gpus("inference") == 1
