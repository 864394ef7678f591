"""Moving a running trainer's state to new ranks: the transfer half of a ``p2p`` migration.

A p2p migration grows or shrinks the trainer's data-parallel group while the job trains. The new
ranks start first, on standby (`Trainer(config, None)`: model and optimizer, no group). Then:

1. **Transfer.** Old and new ranks build a *transfer group* of their own (a store prefix of its
   own, ``TransferRendezvous.prefix``), which leaves the training group untouched. Its rank 0 is
   an old rank; it broadcasts everything a rank's training depends on:

   - the parameters;
   - the AdamW state of every parameter (``step``, ``exp_avg``, ``exp_avg_sq``) and the
     optimizer's hyper-parameters (learning rate, betas, weight decay: the LR schedule's state,
     which for this trainer is constant);
   - the trainer's step count (its weight version) and the torch RNG state;
   - the caller's ``cursor`` (the job's data position: iteration, samples consumed), opaque here.

   Tensors travel as one flat buffer per kind (few large messages, near the link's bandwidth).
2. **Verify.** The header carries a SHA-256 of every buffer; each receiver checks what it got
   before touching its own state, and the group agrees on the outcome (an all-reduce of the
   receivers' verdicts): every rank raises `TransferFailed` unless all of them verified. Only then
   does a receiver load the state, so a transfer that fails leaves no rank half-loaded.
3. **Switch** (the caller, after this returns everywhere): every rank of the new layout calls
   `Trainer.regroup` with a fresh generation of the DP group at the new size (same global batch,
   micro-batches re-split); ranks that leave drop theirs. A failure before the switch kills the
   new ranks, and the old ones carry on in their untouched group as if nothing happened.

Every rank of a data-parallel trainer holds the same state, so one old rank sends it all. Over
gloo (CPU) the buffers travel from host memory; over NCCL (CUDA) they stay on the device.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch._C import _distributed_c10d as c10d

from runtime.rl.trainer import DataParallelRendezvous, Trainer, create_data_parallel_group

SENDER: Final = 0
_FORMAT: Final = 1
_KINDS: Final = ("parameters", "exp_avg", "exp_avg_sq", "adam_step")


class TransferFailed(RuntimeError):
    """The state did not arrive whole on every receiver; no receiver loaded any of it."""


@dataclass(frozen=True)
class TransferRendezvous:
    """The transfer group: every old rank that takes part (at least the sender, rank 0) and every
    new rank, over ``store`` under ``prefix`` (unique per migration, e.g. ``transfer-m17``)."""

    store: c10d.Store
    rank: int
    world_size: int
    prefix: str
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError("a transfer needs a sender and at least one receiver")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a transfer group of {self.world_size}")


@dataclass(frozen=True)
class TransferReport:
    """What one rank sent or received."""

    bytes: int
    seconds: float  # from the group's rendezvous to the verdict
    checksums: Mapping[str, str]  # SHA-256 of each buffer, as sent
    cursor: Mapping[str, Any]
    step: int


def _optimizer_state(trainer: Trainer) -> list[dict[str, Any]]:
    """Each parameter's AdamW state, created empty where no step was taken yet."""
    states = []
    for parameter in trainer.module.parameters():
        state = trainer.optimizer.state[parameter]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        states.append(state)
    return states


def _buffers(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The flat buffers of one rank's state, in the parameters' order (identical on every rank)."""
    parameters = [p.detach() for p in trainer.module.parameters()]
    states = _optimizer_state(trainer)
    return {
        "parameters": torch.cat([p.reshape(-1).float() for p in parameters]),
        "exp_avg": torch.cat([s["exp_avg"].reshape(-1).float() for s in states]),
        "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1).float() for s in states]),
        "adam_step": torch.stack([torch.as_tensor(s["step"], dtype=torch.float32).cpu() for s in states]),
    }


def _rng_state(device: torch.device) -> torch.Tensor:
    """The torch RNG state: the CPU generator's, then the CUDA device's when training on one."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def _layout(trainer: Trainer) -> list[list[Any]]:
    return [[name, list(p.shape)] for name, p in trainer.module.named_parameters()]


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _broadcast_bytes(group: c10d.ProcessGroup, payload: bytes | None, device: torch.device) -> bytes:
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64, device=device)
    group.broadcast(size, SENDER).wait()
    buffer = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if payload is not None
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    group.broadcast(buffer, SENDER).wait()
    return bytes(buffer.cpu().numpy().tobytes())


def _agree(group: c10d.ProcessGroup, ok: bool, device: torch.device) -> bool:
    """True when every rank of the group says ``ok``."""
    verdict = torch.tensor([0.0 if ok else 1.0], device=device)
    group.allreduce([verdict]).wait()
    return float(verdict.item()) == 0.0


def transfer_state(
    trainer: Trainer, rendezvous: TransferRendezvous, cursor: Mapping[str, Any] | None = None
) -> TransferReport:
    """Run this rank's part of a transfer: rank 0 sends ``trainer``'s state and ``cursor``; every
    other rank receives into its standby ``trainer``. Returns once all agreed the state arrived
    whole (receivers have then loaded it); raises `TransferFailed` otherwise, or the group's error
    when a peer dies (the caller then abandons the migration)."""
    device = trainer.device
    group = create_data_parallel_group(
        DataParallelRendezvous(
            store=rendezvous.store,
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
            generation=rendezvous.prefix,
            timeout_s=rendezvous.timeout_s,
        ),
        device,
    )
    started = time.perf_counter()
    sending = rendezvous.rank == SENDER
    mine = _buffers(trainer)
    header: dict[str, Any] | None = None
    if sending:
        rng = _rng_state(device)
        header = {
            "format": _FORMAT,
            "layout": _layout(trainer),
            "sizes": {kind: int(mine[kind].numel()) for kind in _KINDS},
            "checksums": {kind: _digest(mine[kind]) for kind in _KINDS} | {"rng": _digest(rng)},
            "step": trainer.step,
            "param_groups": [
                {key: value for key, value in group_.items() if key != "params"}
                for group_ in trainer.optimizer.param_groups
            ],
            "cursor": dict(cursor or {}),
            "rng_bytes": int(rng.numel()),
        }
    header = json.loads(
        _broadcast_bytes(group, None if header is None else json.dumps(header).encode(), device)
    )
    assert header is not None
    problem = ""
    if not sending and header.get("format") != _FORMAT:
        problem = f"transfer format {header.get('format')}, this rank reads {_FORMAT}"
    elif not sending and header["layout"] != _layout(trainer):
        problem = "the sender's model has other parameters or shapes than this rank's"
    received: dict[str, torch.Tensor] = {}
    total = 0
    for kind in _KINDS:
        buffer = mine[kind].to(device)
        if buffer.numel() != header["sizes"][kind]:  # a layout mismatch, already named above
            buffer = torch.empty(header["sizes"][kind], dtype=torch.float32, device=device)
        group.broadcast(buffer, SENDER).wait()
        received[kind] = buffer.cpu()
        total += buffer.numel() * buffer.element_size()
    rng_state = _rng_state(device) if sending else torch.empty(header["rng_bytes"], dtype=torch.uint8)
    rng_buffer = rng_state.to(device)
    group.broadcast(rng_buffer, SENDER).wait()
    total += int(rng_buffer.numel())
    if not sending and not problem:
        wrong = [kind for kind in _KINDS if _digest(received[kind]) != header["checksums"][kind]]
        if _digest(rng_buffer.cpu()) != header["checksums"]["rng"]:
            wrong.append("rng")
        if wrong:
            problem = f"checksum mismatch in {', '.join(wrong)}"
    if not _agree(group, not problem, device):
        raise TransferFailed(problem or "another receiver did not get the state whole")
    if not sending:
        _load(trainer, received, header, rng_buffer.cpu())
    return TransferReport(
        bytes=total,
        seconds=time.perf_counter() - started,
        checksums=dict(header["checksums"]),
        cursor=dict(header["cursor"]),
        step=int(header["step"]),
    )


@torch.no_grad()
def _load(
    trainer: Trainer, buffers: Mapping[str, torch.Tensor], header: Mapping[str, Any], rng: torch.Tensor
) -> None:
    offset = 0
    states = _optimizer_state(trainer)
    for index, (parameter, state) in enumerate(zip(trainer.module.parameters(), states, strict=True)):
        count = parameter.numel()
        window = slice(offset, offset + count)
        parameter.copy_(buffers["parameters"][window].view_as(parameter))
        state["exp_avg"].copy_(buffers["exp_avg"][window].view_as(parameter))
        state["exp_avg_sq"].copy_(buffers["exp_avg_sq"][window].view_as(parameter))
        state["step"] = buffers["adam_step"][index].clone()
        offset += count
    for group, settings in zip(trainer.optimizer.param_groups, header["param_groups"], strict=True):
        for key, value in settings.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    trainer.step = int(header["step"])
    cpu_bytes = int(torch.get_rng_state().numel())
    torch.set_rng_state(rng[:cpu_bytes].clone())
    if trainer.device.type == "cuda" and rng.numel() > cpu_bytes:
        torch.cuda.set_rng_state(rng[cpu_bytes:].clone(), trainer.device)


def state_checksums(trainer: Trainer) -> dict[str, str]:
    """SHA-256 of this rank's state buffers (what a transfer sends), to compare ranks by."""
    return {kind: _digest(buffer) for kind, buffer in _buffers(trainer).items()}
