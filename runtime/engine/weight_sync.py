"""The process group that carries weights from the trainer to rollout engines.

Both ends use the same helper: the trainer joins as rank 0 (it owns the rendezvous store), each
engine joins at its ``rank_offset``, as in SGLang's ``/init_weights_update_group``. The group is
built directly on a TCP store instead of through ``torch.distributed.init_process_group``, so it
needs no default group and several groups — or both ends, in a test — can live in one process.
On CPU the backend is gloo; NCCL is used only when asked for and CUDA is present.

A push is a sequence of broadcasts from rank 0, one per tensor, in the order of the ``names``
list of ``/update_weights_from_distributed``; the receiving engine allocates each tensor from the
``dtypes`` and ``shapes`` lists of the same request.
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol, cast

import torch

# The store and backend classes are re-exported by torch.distributed at run time but not in its
# type stubs; their home is this extension module.
from torch._C import _distributed_c10d as c10d


class WeightUpdateGroup(Protocol):
    """What a push needs of a gloo or NCCL backend object (present at run time, absent from the
    backend classes' type stubs)."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> c10d.Work: ...


DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name
SUPPORTED_BACKENDS = ("gloo", "nccl")


def create_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 60.0,
) -> WeightUpdateGroup:
    """Join (rank > 0) or host (rank 0) a weight-update group; blocks until every rank joined."""
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"backend must be one of {SUPPORTED_BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which this process does not have; use 'gloo'")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = c10d.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    prefixed = c10d.PrefixStore(group_name, store)
    group: WeightUpdateGroup
    if backend == "gloo":
        group = cast(WeightUpdateGroup, c10d.ProcessGroupGloo(prefixed, rank, world_size, timeout))
    else:
        # Only in CUDA builds of torch, hence looked up rather than imported.
        nccl: Any = c10d.ProcessGroupNCCL  # type: ignore[attr-defined,unused-ignore]
        options = nccl.Options()
        options._timeout = timeout
        group = cast(WeightUpdateGroup, nccl(prefixed, rank, world_size, options))
    # Keep the store alive as long as the group: rank 0's store hosts the rendezvous.
    _STORES[id(group)] = store
    return group


_STORES: dict[int, c10d.TCPStore] = {}


def release_weight_update_group(group: WeightUpdateGroup) -> None:
    _STORES.pop(id(group), None)


def broadcast_from_trainer(group: WeightUpdateGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0's side of one push: broadcast each tensor in order."""
    for tensor in tensors:
        group.broadcast(tensor.contiguous(), 0).wait()


def receive_from_trainer(
    group: WeightUpdateGroup, dtypes: list[str], shapes: list[list[int]], device: str = "cpu"
) -> list[torch.Tensor]:
    """An engine's side of one push: receive each tensor in order."""
    received: list[torch.Tensor] = []
    for dtype_name, shape in zip(dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=parse_dtype(dtype_name), device=device)
        group.broadcast(tensor, 0).wait()
        received.append(tensor)
    return received


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (SGLang sends the former)."""
    candidate = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return candidate


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
