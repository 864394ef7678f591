"""A trainer's state kept on disk across a re-placement: a new trainer that loads it holds exactly
the old one's state and trains on as the old one would have; a torn or foreign file loads nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch._C import _distributed_c10d as c10d

from runtime.rl.checkpoint import CheckpointError, load_trainer_state, save_trainer_state
from runtime.rl.state_transfer import state_checksums
from runtime.rl.trainer import DataParallelRendezvous, Trainer
from runtime.rl.trainer_config import TrainerConfig
from tests.runtime.rl.batches import grpo_batch, trainer_config

torch.set_num_threads(1)

BATCHES = [grpo_batch(groups=4, per_group=2, seed=seed, logprob_noise=0.3) for seed in (21, 22, 23, 24)]


def one_rank(config: TrainerConfig, generation: str) -> Trainer:
    return Trainer(
        config, DataParallelRendezvous(store=c10d.HashStore(), rank=0, world_size=1, generation=generation)
    )


def test_a_loaded_state_is_the_saved_one_exactly_and_training_goes_on_as_without_the_stop(
    tmp_path: Path,
) -> None:
    config = trainer_config(len(BATCHES[0]), 4)
    through = one_rank(config, "through")
    metrics = [through.train_step(batch) for batch in BATCHES]

    stopped = one_rank(config, "before")
    for batch in BATCHES[:2]:
        stopped.train_step(batch)
    torch.manual_seed(1234)  # the RNG state travels too
    kept = save_trainer_state(stopped, tmp_path / "job-1" / "trainer.pt", {"trained_iteration": 1})
    assert kept.step == 2 and kept.bytes > 0
    expected_rng = torch.get_rng_state()

    torch.manual_seed(0)
    resumed = one_rank(config, "after")  # a fresh rank, from the same seed, not yet trained
    assert state_checksums(resumed) != state_checksums(stopped)
    loaded = load_trainer_state(resumed, kept.path)
    assert loaded.cursor == {"trained_iteration": 1} and loaded.step == resumed.step == 2
    # Parameters, exp_avg, exp_avg_sq and the AdamW step counts, bit for bit.
    assert state_checksums(resumed) == state_checksums(stopped)
    assert torch.equal(torch.get_rng_state(), expected_rng)
    after = [resumed.train_step(batch) for batch in BATCHES[2:]]
    # The same arithmetic on the same state: the losses are those of the run that never stopped.
    assert [(m.grpo, m.grad_norm, m.step) for m in after] == [
        (m.grpo, m.grad_norm, m.step) for m in metrics[2:]
    ]
    for name, tensor in through.engine_weights().items():
        assert torch.equal(tensor, resumed.engine_weights()[name]), name
    for rank in (through, stopped, resumed):
        rank.close()


def test_a_torn_missing_or_foreign_state_is_refused_and_nothing_is_loaded(tmp_path: Path) -> None:
    config = trainer_config(len(BATCHES[0]), 4)
    trainer = one_rank(config, "a")
    trainer.train_step(BATCHES[0])
    path = save_trainer_state(trainer, tmp_path / "trainer.pt", {"trained_iteration": 0}).path
    fresh = one_rank(config, "b")
    before = state_checksums(fresh)

    with pytest.raises(CheckpointError, match="no trainer state"):
        load_trainer_state(fresh, tmp_path / "absent.pt")
    torn = tmp_path / "torn.pt"
    torn.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="not whole"):
        load_trainer_state(fresh, torn)
    bigger = replace(config.model, hidden_size=config.model.hidden_size * 2)
    other = one_rank(replace(config, model=bigger), "c")
    with pytest.raises(CheckpointError, match="another model"):
        load_trainer_state(other, path)
    assert state_checksums(fresh) == before
    # No partial file is left beside the kept one.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torn.pt", "trainer.pt"]
    for rank in (trainer, fresh, other):
        rank.close()
