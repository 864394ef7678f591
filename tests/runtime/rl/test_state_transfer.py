"""The trainer's p2p migration (runtime/rl/state_transfer.py) across real processes over gloo:
the state arrives exact, training goes on at the new size as a run without the migration does,
and a new rank dying mid-transfer leaves the old rank training as if nothing happened."""

from __future__ import annotations

import multiprocessing
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._C import _distributed_c10d as c10d

from runtime.rl.grpo import Trajectory
from runtime.rl.state_transfer import (
    TransferFailed,
    TransferRendezvous,
    abandon_transfer,
    state_checksums,
    transfer_state,
)
from runtime.rl.trainer import DataParallelRendezvous, Trainer, TrainStepMetrics
from tests.runtime.rl.batches import grpo_batch, trainer_config
from tests.runtime.rl.migrating_ranks import BEFORE, MICRO_BATCH, grow, new_rank_dies, run_rank, shrink
from tests.services import wait_until

torch.set_num_threads(1)

# Four global batches of 8 with noisy sampling log-probs (clipping and the KL term take part).
BATCHES = [grpo_batch(groups=4, per_group=2, seed=seed, logprob_noise=0.3) for seed in (11, 12, 13, 14)]


def run_ranks(
    body: Callable[[int, str, list[list[Trajectory]]], None], ranks: int
) -> tuple[dict[str, Any], list[int]]:
    """Run ``body`` in ``ranks`` spawned processes; returns what they saved and their exit codes."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as scratch:
        processes = [context.Process(target=run_rank, args=(body, i, scratch, BATCHES)) for i in range(ranks)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(240)
            if process.is_alive():
                process.kill()
        saved = {p.stem: torch.load(p, weights_only=False) for p in Path(scratch).glob("*.pt")}
    return saved, [int(p.exitcode if p.exitcode is not None else -9) for p in processes]


def unmigrated() -> tuple[dict[str, torch.Tensor], list[TrainStepMetrics]]:
    """The same four steps on one rank, no migration: what the migrated runs are held against."""
    with Trainer(
        trainer_config(len(BATCHES[0]), MICRO_BATCH),
        DataParallelRendezvous(store=c10d.HashStore(), rank=0, world_size=1, generation="alone"),
    ) as trainer:
        metrics = [trainer.train_step(batch) for batch in BATCHES]
        return trainer.engine_weights(), metrics


def max_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys()
    return max(float((left[name] - right[name]).abs().max()) for name in left)


def test_growing_moves_the_exact_state_and_training_continues_as_without_the_migration() -> None:
    saved, codes = run_ranks(grow, 2)
    assert codes == [0, 0], saved.keys()
    old, new = saved["old"], saved["new"]
    # Exact: parameters, AdamW's exp_avg, exp_avg_sq and step, bit for bit (SHA-256 of each).
    assert new["received"] == old["sent"] != new["standby"]
    assert new["report"].checksums == old["report"].checksums  # the wire's checksums, as both ends saw them
    assert (new["step_after_transfer"], new["report"].cursor) == (BEFORE, {"iteration": 2})
    assert old["world"] == 2
    # After the switch both ranks apply the same all-reduced update: identical weights.
    assert max_difference(old["weights"], new["weights"]) == 0.0
    # Against one rank that never migrated: the first two steps are that run's own (same process,
    # same world), the last two differ only by DP=2's summation order. The trainer tests measure
    # that order effect at 2.3e-7 on the weights after two steps; 1e-5 holds it to 1% of a step.
    reference, reference_metrics = unmigrated()
    metrics: list[TrainStepMetrics] = old["metrics"]
    for migrated, alone in zip(metrics[:BEFORE], reference_metrics[:BEFORE], strict=True):
        assert migrated.grpo == alone.grpo
    for migrated, alone in zip(metrics[BEFORE:], reference_metrics[BEFORE:], strict=True):
        assert migrated.step == alone.step
        assert migrated.grpo.loss == pytest.approx(alone.grpo.loss, abs=1e-6)
        assert migrated.grad_norm == pytest.approx(alone.grad_norm, rel=1e-5)
        assert migrated.micro_batches == 2 and alone.micro_batches == 4  # re-split over two ranks
    assert [m.step for m in new["metrics"]] == [3, 4]
    assert max_difference(old["weights"], reference) < 1e-5


def test_shrinking_onto_a_new_rank_moves_the_state_and_the_old_ranks_leave() -> None:
    saved, codes = run_ranks(shrink, 3)
    assert codes == [0, 0, 0], saved.keys()
    assert saved["new"]["received"] == saved["old0"]["checksums"] == saved["old1"]["checksums"]
    assert saved["new"]["world"] == 1
    reference, reference_metrics = unmigrated()
    for migrated, alone in zip(saved["new"]["metrics"], reference_metrics[BEFORE:], strict=True):
        assert migrated.step == alone.step
        assert migrated.grpo.loss == pytest.approx(alone.grpo.loss, abs=1e-6)
        assert migrated.micro_batches == alone.micro_batches == 4
    assert max_difference(saved["new"]["weights"], reference) < 1e-5


def test_a_new_rank_dying_mid_transfer_leaves_the_old_rank_training_as_if_nothing_happened() -> None:
    saved, codes = run_ranks(new_rank_dies, 2)
    assert codes == [0, 3], sorted(saved)
    old = saved["old"]
    assert old["error"], "the sender's transfer should have failed"
    assert old["after_failure"] == old["untouched"]
    assert old["generation"] == "dp-0"  # its training group was never left
    # Bit for bit the run without a migration: same process layout, same world of one.
    reference, reference_metrics = unmigrated()
    assert max_difference(old["weights"], reference) == 0.0
    assert [m.grpo for m in old["metrics"]] == [m.grpo for m in reference_metrics]


def trained_rank() -> Trainer:
    """A rank alone in its training group, one step in: a sender whose transfer is about to fail."""
    rank = Trainer(
        trainer_config(len(BATCHES[0]), MICRO_BATCH),
        DataParallelRendezvous(store=c10d.HashStore(), rank=0, world_size=1, generation="dp-0"),
    )
    rank.train_step(BATCHES[0])
    return rank


def test_a_transfer_abandoned_before_a_receiver_arrives_frees_the_sender_at_once() -> None:
    # The receiver died before it reached the transfer: whoever learns of it (the driver, from
    # the receiver's failed call) abandons the transfer, and the sender, a rank of the running
    # trainer, gives up with that reason instead of waiting out the rendezvous' timeout.
    sender = trained_rank()
    untouched = state_checksums(sender)
    store = c10d.HashStore()
    rendezvous = TransferRendezvous(store, rank=0, world_size=2, prefix="transfer-m9-a1", timeout_s=3600.0)
    outcome: list[BaseException] = []

    def send() -> None:
        try:
            transfer_state(sender, rendezvous, {"iteration": 1})
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    assert wait_until(lambda: store.check(["transfer-m9-a1/present/0"]), timeout_s=30)
    abandon_transfer(store, "transfer-m9-a1", "actor-m9-w0 failed: its actor died")
    thread.join(30)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], TransferFailed)
    assert str(outcome[0]) == "the transfer was abandoned: actor-m9-w0 failed: its actor died"
    assert state_checksums(sender) == untouched
    assert sender.train_step(BATCHES[1]).step == 2  # it trains on in its own group
    sender.close()


def test_a_receiver_that_checks_in_and_never_connects_fails_the_transfer_at_the_connect() -> None:
    # The receiver died between its check-in and the group's connect: nobody abandons the
    # transfer, and the sender gives up after the connect timeout, not the transfer's hour.
    sender = trained_rank()
    untouched = state_checksums(sender)
    store = c10d.HashStore()
    rendezvous = TransferRendezvous(
        store, rank=0, world_size=2, prefix="transfer-m9-a2", timeout_s=3600.0, connect_timeout_s=1.0
    )
    store.set("transfer-m9-a2/present/1", "1")  # the receiver arrived, then died
    with pytest.raises(TransferFailed, match="checked in but did not connect within 1 s"):
        transfer_state(sender, rendezvous, {"iteration": 1})
    assert state_checksums(sender) == untouched
    assert sender.train_step(BATCHES[1]).step == 2  # it trains on in its own group
    sender.close()


def test_a_transfer_needs_a_sender_and_a_receiver_and_a_standby_rank_cannot_train() -> None:
    with pytest.raises(ValueError, match="a sender and at least one receiver"):
        TransferRendezvous(c10d.HashStore(), 0, 1, "transfer-x")
    standby = Trainer(trainer_config(len(BATCHES[0]), MICRO_BATCH), None)
    with pytest.raises(RuntimeError, match="on standby"):
        standby.train_step(BATCHES[0])
    assert set(state_checksums(standby)) == {"parameters", "exp_avg", "exp_avg_sq", "adam_step"}
