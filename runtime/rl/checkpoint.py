"""A trainer's state kept on disk across a re-placement of its job.

A job placed anew at an iteration boundary (colocated <-> disaggregated) stops every worker and
starts the new layout's on the same devices: the trainer's ranks do not survive it, so what they
hold must. Before its ranks stop, the old trainer's rank 0 writes its state here; the new ranks
read it before the job's next iteration, so training resumes where it stopped instead of from
the warm start:

- the parameters (the module's state dict) and the AdamW state (``step``, ``exp_avg``,
  ``exp_avg_sq`` and the hyper-parameters: ``optimizer.state_dict()``, exact);
- the trainer's step count (its weight version) and the torch RNG state;
- the caller's ``cursor`` (the job's data position: the iteration last trained), opaque here.

The file is written beside its final name and renamed over it, so a reader finds the previous
state or the new one whole, never a torn one; a digest of the payload is checked on load. The
directory must be one every node of the job reads (shared storage on a real cluster), as Ray
Train's ``storage_path`` must be.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from runtime.rl.state_transfer import parameter_layout, rng_state, set_rng_state
from runtime.rl.trainer import Trainer

_FORMAT: Final = 1


class CheckpointError(RuntimeError):
    """The file is not a whole trainer state this trainer can load; nothing was loaded."""


@dataclass(frozen=True)
class KeptState:
    """What a saved or loaded state holds, besides its tensors."""

    path: Path
    step: int
    cursor: Mapping[str, Any]
    bytes: int


def save_trainer_state(trainer: Trainer, path: Path, cursor: Mapping[str, Any]) -> KeptState:
    """Write ``trainer``'s whole state and ``cursor`` to ``path`` (atomically)."""
    state = {
        "format": _FORMAT,
        "layout": parameter_layout(trainer),
        "step": trainer.step,
        "model": trainer.module.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "rng": rng_state(trainer.device),
        "cursor": dict(cursor),
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as handle:
        handle.write(hashlib.sha256(payload).hexdigest().encode() + b"\n")
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    return KeptState(path=path, step=trainer.step, cursor=dict(cursor), bytes=len(payload))


def load_trainer_state(trainer: Trainer, path: Path) -> KeptState:
    """Load the state at ``path`` into ``trainer`` (every rank of a data-parallel trainer loads
    the same one). Raises ``CheckpointError`` and loads nothing when the file is missing, torn,
    of another format or of another model."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"no trainer state at {path}: {exc.strerror or exc}") from exc
    digest, _, payload = raw.partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"the trainer state at {path} is not whole (its digest does not match)")
    state = torch.load(io.BytesIO(payload), map_location=trainer.device, weights_only=True)
    if state.get("format") != _FORMAT:
        raise CheckpointError(f"the trainer state at {path} is format {state.get('format')}, not {_FORMAT}")
    if state["layout"] != parameter_layout(trainer):
        raise CheckpointError(
            f"the trainer state at {path} is of another model (parameters or shapes differ)"
        )
    trainer.module.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.step = int(state["step"])
    set_rng_state(state["rng"].cpu(), trainer.device)
    return KeptState(path=path, step=trainer.step, cursor=dict(state["cursor"]), bytes=len(payload))
