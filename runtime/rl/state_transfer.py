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

   Tensors travel as they live in the rank, posted back to back (the link stays busy; no staging
   copy on either end: a receiver receives into its own parameters and optimizer state).
2. **Verify.** Every tensor's checksum (XXH3, 64-bit) is computed on both ends while the next
   ones are on the wire (so checking costs little time of its own), and the sender's follow the
   data; each receiver
   compares, and the group agrees on the outcome (an all-reduce of the receivers' verdicts): every
   rank raises `TransferFailed` unless all of them verified, and only then do the receivers take
   the step counts, settings, step and RNG. A failed transfer leaves the old ranks untouched (the
   sender only reads) and the new ones unusable, which the rollback then destroys.
   (`state_checksums`, a SHA-256 of each flattened buffer, compares whole ranks afterwards.)
3. **Switch** (the caller, after this returns everywhere): every rank of the new layout calls
   `Trainer.regroup` with a fresh generation of the DP group at the new size (same global batch,
   micro-batches re-split); ranks that leave drop theirs. A failure before the switch kills the
   new ranks, and the old ones carry on in their untouched group as if nothing happened.

Every rank of a data-parallel trainer holds the same state, so one old rank sends it all. Over
gloo (CPU) the buffers travel from host memory; over NCCL (CUDA) they stay on the device.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
import xxhash
from torch._C import _distributed_c10d as c10d

from runtime.rl.trainer import DataParallelRendezvous, Trainer, create_data_parallel_group

SENDER: Final = 0
_FORMAT: Final = 3
# How often a rank waiting for the others to check in looks whether the transfer was abandoned.
CHECK_IN_POLL_S: Final = 0.05


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
    # Once every rank has checked in, building the group only connects them (milliseconds); a
    # rank that dies in between would otherwise hold the others for ``timeout_s``. The
    # collectives keep ``timeout_s``.
    connect_timeout_s: float = 20.0

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
    checksums: Mapping[str, str]  # per kind of tensor, a digest of their checksums as sent
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


def rng_state(device: torch.device) -> torch.Tensor:
    """The torch RNG state: the CPU generator's, then the CUDA device's when training on one."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def parameter_layout(trainer: Trainer) -> list[list[Any]]:
    """Each parameter's name, shape and dtype: what two ranks' states must share to be exchanged."""
    return [
        [name, list(p.shape), str(p.dtype).removeprefix("torch.")]
        for name, p in trainer.module.named_parameters()
    ]


def _digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (read in place on the CPU, no copy)."""
    host = tensor.detach().cpu().contiguous()
    return hashlib.sha256(host.numpy().data.cast("B")).hexdigest()


def _checksum(tensor: torch.Tensor) -> int:
    """XXH3 (64-bit) of a tensor's bytes: what the transfer checks each tensor by. It releases
    the GIL, so it runs while the next tensors are on the wire, at several times CRC-32's speed."""
    host = tensor.detach().cpu().contiguous()
    return int(xxhash.xxh3_64_intdigest(host.numpy().data.cast("B")))


def _broadcast(group: c10d.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> c10d.Work:
    """The sender's ``tensor`` to every rank, with the transfer's timeout rather than the
    group's (which only bounds its connect)."""
    options = c10d.BroadcastOptions()
    options.rootRank = SENDER
    options.rootTensor = 0
    options.timeout = datetime.timedelta(seconds=timeout_s)
    return group.broadcast([tensor], options)


def _broadcast_bytes(
    group: c10d.ProcessGroup, payload: bytes | None, device: torch.device, timeout_s: float
) -> bytes:
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64, device=device)
    _broadcast(group, size, timeout_s).wait()
    buffer = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if payload is not None
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    _broadcast(group, buffer, timeout_s).wait()
    return bytes(buffer.cpu().numpy().tobytes())


def _agree(group: c10d.ProcessGroup, ok: bool, device: torch.device, timeout_s: float) -> bool:
    """True when every rank of the group says ``ok``."""
    verdict = torch.tensor([0.0 if ok else 1.0], device=device)
    options = c10d.AllreduceOptions()
    options.timeout = datetime.timedelta(seconds=timeout_s)
    group.allreduce([verdict], options).wait()
    return float(verdict.item()) == 0.0


def _wire(trainer: Trainer) -> list[tuple[str, torch.Tensor]]:
    """The tensors a transfer moves, in order, as they live in the rank: the parameters, then each
    one's AdamW ``exp_avg`` and ``exp_avg_sq``. A receiver receives into its own in place."""
    parameters = [p.data for p in trainer.module.parameters()]
    states = _optimizer_state(trainer)
    return (
        [("parameters", p) for p in parameters]
        + [("exp_avg", s["exp_avg"]) for s in states]
        + [("exp_avg_sq", s["exp_avg_sq"]) for s in states]
    )


def abandon_transfer(store: c10d.Store, prefix: str, why: str) -> None:
    """Tell the ranks of the transfer under ``prefix`` still waiting for the others to check in
    to give up now, with ``why`` (a receiver that died before it arrived would otherwise keep the
    sender, a rank of the running trainer, waiting out the whole timeout)."""
    store.set(f"{prefix}/abandoned", why)


def _check_in(rendezvous: TransferRendezvous) -> None:
    """Wait until every rank of the transfer has arrived, or it was abandoned, or the timeout.
    Only then is the group built: its own rendezvous cannot be interrupted."""
    store, prefix = rendezvous.store, rendezvous.prefix
    store.set(f"{prefix}/present/{rendezvous.rank}", "1")
    everyone = [f"{prefix}/present/{rank}" for rank in range(rendezvous.world_size)]
    abandoned = f"{prefix}/abandoned"
    deadline = time.monotonic() + rendezvous.timeout_s
    while not store.check(everyone):
        if store.check([abandoned]):
            raise TransferFailed(f"the transfer was abandoned: {store.get(abandoned).decode()}")
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(everyone) if not store.check([key])]
            raise TransferFailed(f"rank(s) {missing} did not arrive within {rendezvous.timeout_s:g} s")
        time.sleep(CHECK_IN_POLL_S)


def transfer_state(
    trainer: Trainer, rendezvous: TransferRendezvous, cursor: Mapping[str, Any] | None = None
) -> TransferReport:
    """Run this rank's part of a transfer: rank 0 sends ``trainer``'s state and ``cursor``; every
    other rank receives into its standby ``trainer``. Returns once all agreed the state arrived
    whole; raises `TransferFailed` otherwise, or the group's error when a peer dies (the caller then
    abandons the migration, and its new ranks with it).

    The wire: a JSON header (layout, settings, step, cursor), then every tensor as it lives in the
    rank, all posted at once so they stream back to back (no staging copy on either end: a
    receiver receives into its own parameters and optimizer state), each tensor's checksum computed
    as soon as it is there (the sender's as they leave), then the AdamW step counts and the RNG
    state, then the sender's checksums; each receiver compares, and the group agrees on the verdict. The
    step counts, settings, step and RNG are applied only then. The sender only reads.

    Before the group is built, every rank checks in on the store: a transfer abandoned meanwhile
    (``abandon_transfer``, when a receiver is known dead) raises `TransferFailed` at once. The
    group then connects within ``connect_timeout_s`` (a rank that died after checking in fails it
    then, not after ``timeout_s``); its collectives run under ``timeout_s``."""
    device = trainer.device
    timeout_s = rendezvous.timeout_s
    _check_in(rendezvous)
    connect_s = min(rendezvous.connect_timeout_s, timeout_s)
    try:
        group = create_data_parallel_group(
            DataParallelRendezvous(
                store=rendezvous.store,
                rank=rendezvous.rank,
                world_size=rendezvous.world_size,
                generation=rendezvous.prefix,
                timeout_s=connect_s,
            ),
            device,
        )
    except RuntimeError as exc:  # gloo's connect timed out or a peer's socket closed
        raise TransferFailed(
            f"the ranks checked in but did not connect within {connect_s:g} s: {exc}"
        ) from exc
    started = time.perf_counter()
    sending = rendezvous.rank == SENDER
    header: dict[str, Any] | None = None
    if sending:
        header = {
            "format": _FORMAT,
            "layout": parameter_layout(trainer),
            "step": trainer.step,
            "param_groups": [
                {key: value for key, value in group_.items() if key != "params"}
                for group_ in trainer.optimizer.param_groups
            ],
            "cursor": dict(cursor or {}),
            "rng_bytes": int(rng_state(device).numel()),
        }
    header = json.loads(
        _broadcast_bytes(group, None if header is None else json.dumps(header).encode(), device, timeout_s)
    )
    assert header is not None
    if not sending and header.get("format") != _FORMAT:
        raise TransferFailed(f"transfer format {header.get('format')}, this rank reads {_FORMAT}")
    if not sending and header["layout"] != parameter_layout(trainer):
        # Nothing can be received into this model: the sender's first broadcast then fails or
        # its verdict never comes, and the migration is abandoned.
        raise TransferFailed("the sender's model has other parameters or shapes than this rank's")
    wire = _wire(trainer)
    states = _optimizer_state(trainer)
    if sending:
        steps = torch.stack([torch.as_tensor(s["step"], dtype=torch.float32).cpu() for s in states]).to(
            device
        )
        rng = rng_state(device).to(device)
    else:
        steps = torch.empty(len(states), dtype=torch.float32, device=device)
        rng = torch.empty(int(header["rng_bytes"]), dtype=torch.uint8, device=device)
    tensors = [*wire, ("adam_step", steps), ("rng", rng)]
    works = [_broadcast(group, tensor, timeout_s) for _, tensor in tensors]
    sums: list[int] = []
    for (_, tensor), work in zip(tensors, works, strict=True):
        if not sending:
            work.wait()
        sums.append(_checksum(tensor))
    for work in works:
        work.wait()
    sent = json.loads(
        _broadcast_bytes(group, json.dumps(sums).encode() if sending else None, device, timeout_s)
    )
    problem = ""
    if not sending:
        wrong = sorted(
            {kind for (kind, _), mine, theirs in zip(tensors, sums, sent, strict=True) if mine != theirs}
        )
        if wrong:
            problem = f"checksum mismatch in {', '.join(wrong)}"
    if not _agree(group, not problem, device, timeout_s):
        raise TransferFailed(problem or "another receiver did not get the state whole")
    if not sending:
        _apply(trainer, states, steps.cpu(), header, rng.cpu())
    by_kind: dict[str, list[int]] = {}
    for (kind, _), checksum in zip(tensors, sent, strict=True):
        by_kind.setdefault(kind, []).append(checksum)
    return TransferReport(
        bytes=sum(tensor.numel() * tensor.element_size() for _, tensor in tensors),
        seconds=time.perf_counter() - started,
        checksums={
            kind: f"{xxhash.xxh3_64_intdigest(json.dumps(sums).encode()):016x}"
            for kind, sums in by_kind.items()
        },
        cursor=dict(header["cursor"]),
        step=int(header["step"]),
    )


@torch.no_grad()
def _apply(
    trainer: Trainer,
    states: list[dict[str, Any]],
    steps: torch.Tensor,
    header: Mapping[str, Any],
    rng: torch.Tensor,
) -> None:
    """What a receiver sets once the state is verified (the tensors are already in place)."""
    for state, step in zip(states, steps, strict=True):
        state["step"] = step.clone()
    for group, settings in zip(trainer.optimizer.param_groups, header["param_groups"], strict=True):
        for key, value in settings.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    trainer.step = int(header["step"])
    set_rng_state(rng, trainer.device)


def set_rng_state(rng: torch.Tensor, device: torch.device) -> None:
    """Restore what ``rng_state`` returned (on the CPU)."""
    cpu_bytes = int(torch.get_rng_state().numel())
    torch.set_rng_state(rng[:cpu_bytes].clone())
    if device.type == "cuda" and rng.numel() > cpu_bytes:
        torch.cuda.set_rng_state(rng[cpu_bytes:].clone(), device)


def state_checksums(trainer: Trainer) -> dict[str, str]:
    """SHA-256 of this rank's state buffers (what a transfer sends), to compare ranks by."""
    return {kind: _digest(buffer) for kind, buffer in _buffers(trainer).items()}
