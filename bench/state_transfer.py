"""How fast a p2p migration moves the trainer's state, against raw torch.distributed in the same run.

    python -m bench.state_transfer
    python -m bench.state_transfer --hidden 512 --layers 8 --repeats 6

Two processes on this machine, one old trainer rank and one new one on standby, joined by a
FileStore. For each repeat the old rank (having taken one AdamW step, so its optimizer state is
real) sends its whole state with ``runtime.rl.state_transfer.transfer_state`` (parameters, AdamW
``exp_avg``/``exp_avg_sq``/``step``, settings, RNG; SHA-256-verified on the receiver), and then the
same number of bytes goes as plain ``send``/``recv`` of one float32 tensor over a gloo group of the
same two processes: the link's raw rate. It prints, per repeat and as the median, the bytes moved,
each one's time and rate, and the ratio; and how the transfer's time splits into moving and
verifying (hashing both ends).

On a GPU host the same code moves the buffers over NCCL; here it is gloo over loopback TCP.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d

from runtime.model.config import GPTConfig
from runtime.rl.grpo import GRPOConfig
from runtime.rl.state_transfer import TransferRendezvous, state_checksums, transfer_state
from runtime.rl.trainer import DataParallelRendezvous, Trainer, create_data_parallel_group
from runtime.rl.trainer_config import TrainerConfig
from runtime.task.tokenizer import CharTokenizer

TIMEOUT_S = 600.0


def trainer_config(hidden: int, layers: int) -> TrainerConfig:
    model = GPTConfig(
        vocab_size=CharTokenizer().vocab_size,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(1, hidden // 64),
        ffn_hidden_size=4 * hidden,
        max_positions=256,
    )
    return TrainerConfig(model=model, global_batch_size=1, micro_batch_size=1, grpo=GRPOConfig())


def _take_a_step(trainer: Trainer) -> None:
    """Fill the optimizer's state with one real AdamW step (on a synthetic loss)."""
    loss = torch.stack([parameter.float().pow(2).sum() for parameter in trainer.module.parameters()]).sum()
    torch.autograd.backward(loss)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step += 1


def rank_body(rank: int, scratch: str, hidden: int, layers: int, repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = c10d.FileStore(str(Path(scratch) / "store"), 2)
    config = trainer_config(hidden, layers)
    trainer = Trainer(config, None)
    if rank == 0:
        _take_a_step(trainer)
    raw_group = create_data_parallel_group(
        DataParallelRendezvous(store, rank, 2, "raw", TIMEOUT_S), trainer.device
    )
    rows = []
    for repeat in range(repeats):
        started = time.perf_counter()
        report = transfer_state(trainer, TransferRendezvous(store, rank, 2, f"transfer-{repeat}", TIMEOUT_S))
        transfer_s = time.perf_counter() - started
        hashed = time.perf_counter()
        state_checksums(trainer)  # what verification costs one end
        hash_s = time.perf_counter() - hashed
        buffer = (
            torch.ones(report.bytes // 4, dtype=torch.float32)
            if rank == 0
            else torch.empty(report.bytes // 4)
        )
        raw_group.barrier().wait()
        started = time.perf_counter()
        if rank == 0:
            raw_group.send([buffer], 1, 0).wait()
        else:
            raw_group.recv([buffer], 0, 0).wait()
        raw_s = time.perf_counter() - started
        rows.append({"bytes": report.bytes, "transfer_s": transfer_s, "raw_s": raw_s, "hash_s": hash_s})
    if rank == 1:
        out.put(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.state_transfer", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        processes = [
            context.Process(
                target=rank_body, args=(r, scratch, args.hidden, args.layers, args.repeats, results)
            )
            for r in (0, 1)
        ]
        for process in processes:
            process.start()
        rows: list[dict[str, float]] = results.get(timeout=TIMEOUT_S)
        for process in processes:
            process.join(TIMEOUT_S)
    gib = 1024**3
    print(
        f"Trainer state of a {args.layers}-layer, {args.hidden}-wide GPT (gloo over loopback, 2 processes)\n"
    )
    print(
        "| repeat | MiB | transfer s | transfer GiB/s | raw send/recv s | raw GiB/s | ratio | SHA-256 of a whole rank s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for index, row in enumerate(rows):
        print(
            f"| {index} | {row['bytes'] / 2**20:.0f} | {row['transfer_s']:.3f} | "
            f"{row['bytes'] / row['transfer_s'] / gib:.2f} | {row['raw_s']:.3f} | "
            f"{row['bytes'] / row['raw_s'] / gib:.2f} | {row['raw_s'] / row['transfer_s']:.0%} | {row['hash_s']:.3f} |"
        )
    transfer = statistics.median(r["transfer_s"] for r in rows)
    raw = statistics.median(r["raw_s"] for r in rows)
    print(f"\nmedian: transfer {transfer:.3f} s, raw {raw:.3f} s, ratio {raw / transfer:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
