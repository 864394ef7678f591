"""The processes of the p2p-migration tests: old and new trainer ranks (module-level functions, so
a spawned child can import them). Each rank writes what it saw to ``<scratch>/<role>.pt``."""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d

from runtime.rl.grpo import Trajectory
from runtime.rl.state_transfer import TransferRendezvous, state_checksums, transfer_state
from runtime.rl.trainer import DataParallelRendezvous, Trainer, create_data_parallel_group
from tests.runtime.rl.batches import trainer_config

# Every test trains four steps: two before the migration, two after.
BEFORE = 2
MICRO_BATCH = 2
TIMEOUT_S = 60.0
# A rank still running after this long is hung (the test kills it at 240 s): every thread's stack
# goes to stderr first, which the failing test's report shows.
HUNG_AFTER_S = 200.0


def run_rank(
    body: Callable[[int, str, list[list[Trajectory]]], None],
    index: int,
    scratch: str,
    batches: list[list[Trajectory]],
) -> None:
    """A spawned process's target: ``body`` as rank ``index``, its stacks dumped if it hangs."""
    faulthandler.dump_traceback_later(HUNG_AFTER_S)
    body(index, scratch, batches)


def _store(scratch: str, users: int) -> c10d.Store:
    return c10d.FileStore(str(Path(scratch) / "store"), users)


def _dp(store: c10d.Store, rank: int, world: int, generation: str) -> DataParallelRendezvous:
    return DataParallelRendezvous(
        store=store, rank=rank, world_size=world, generation=generation, timeout_s=TIMEOUT_S
    )


def _save(scratch: str, role: str, trainer: Trainer, **seen: Any) -> None:
    torch.save({"weights": trainer.engine_weights(), **seen}, Path(scratch) / f"{role}.pt")


def grow(index: int, scratch: str, batches: list[list[Trajectory]]) -> None:
    """1 -> 2 ranks. Rank ``old`` trains alone, then sends its state to the standby rank ``new``;
    both switch to a DP group of two and train on."""
    torch.set_num_threads(1)
    store = _store(scratch, 2)
    config = trainer_config(len(batches[0]), MICRO_BATCH)
    if index == 0:
        trainer = Trainer(config, _dp(store, 0, 1, "dp-0"))
        before = [trainer.train_step(batch) for batch in batches[:BEFORE]]
        sent = state_checksums(trainer)
        report = transfer_state(
            trainer, TransferRendezvous(store, 0, 2, "transfer-1", TIMEOUT_S), {"iteration": 2}
        )
        trainer.regroup(_dp(store, 0, 2, "dp-1"))
        after = [trainer.train_step(batch) for batch in batches[BEFORE:]]
        _save(
            scratch,
            "old",
            trainer,
            sent=sent,
            report=report,
            metrics=before + after,
            world=trainer.world_size,
        )
        trainer.close()
    else:
        trainer = Trainer(config, None)
        standby = state_checksums(trainer)
        report = transfer_state(trainer, TransferRendezvous(store, 1, 2, "transfer-1", TIMEOUT_S))
        received = state_checksums(trainer)
        trainer.regroup(_dp(store, 1, 2, "dp-1"))
        after = [trainer.train_step(batch) for batch in batches[BEFORE:]]
        _save(
            scratch,
            "new",
            trainer,
            standby=standby,
            received=received,
            report=report,
            step_after_transfer=report.step,
            metrics=after,
        )
        trainer.close()


def shrink(index: int, scratch: str, batches: list[list[Trajectory]]) -> None:
    """2 -> 1 ranks onto a new rank: the two old ranks train, old rank 0 sends the state to a new
    standby rank, both old ranks leave, and the new rank trains on alone (a move of the whole
    trainer; dropping one of two ranks is the same switch without the transfer)."""
    torch.set_num_threads(1)
    store = _store(scratch, 3)
    config = trainer_config(len(batches[0]), MICRO_BATCH)
    if index < 2:
        trainer = Trainer(config, _dp(store, index, 2, "dp-0"))
        before = [trainer.train_step(batch) for batch in batches[:BEFORE]]
        if index == 0:
            transfer_state(trainer, TransferRendezvous(store, 0, 2, "transfer-1", TIMEOUT_S))
        trainer.leave_group()
        _save(scratch, f"old{index}", trainer, metrics=before, checksums=state_checksums(trainer))
        trainer.close()
    else:
        trainer = Trainer(config, None)
        transfer_state(trainer, TransferRendezvous(store, 1, 2, "transfer-1", TIMEOUT_S))
        received = state_checksums(trainer)
        trainer.regroup(_dp(store, 0, 1, "dp-1"))
        after = [trainer.train_step(batch) for batch in batches[BEFORE:]]
        _save(scratch, "new", trainer, received=received, metrics=after, world=trainer.world_size)
        trainer.close()


def new_rank_dies(index: int, scratch: str, batches: list[list[Trajectory]]) -> None:
    """The new rank dies in the middle of the transfer (after the header's size, before the
    state): the old rank's transfer fails, and it trains on in its untouched group."""
    torch.set_num_threads(1)
    store = _store(scratch, 2)
    config = trainer_config(len(batches[0]), MICRO_BATCH)
    if index == 0:
        trainer = Trainer(config, _dp(store, 0, 1, "dp-0"))
        before = [trainer.train_step(batch) for batch in batches[:BEFORE]]
        untouched = state_checksums(trainer)
        try:
            transfer_state(trainer, TransferRendezvous(store, 0, 2, "transfer-1", TIMEOUT_S))
            error = ""
        except Exception as exc:  # the group's error: whatever gloo raises when a peer is gone
            error = f"{type(exc).__name__}: {exc}"
        after_failure = state_checksums(trainer)
        after = [trainer.train_step(batch) for batch in batches[BEFORE:]]
        _save(
            scratch,
            "old",
            trainer,
            error=error,
            untouched=untouched,
            after_failure=after_failure,
            metrics=before + after,
            generation=trainer.generation,
        )
        trainer.close()
    else:
        # A receiver's first steps, as transfer_state takes them: check in, join the group.
        store.set("transfer-1/present/1", "1")
        group = create_data_parallel_group(_dp(store, 1, 2, "transfer-1"), torch.device("cpu"))
        size = torch.zeros(1, dtype=torch.int64)
        group.broadcast(size, 0).wait()
        os._exit(3)
