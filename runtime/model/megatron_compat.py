"""Running megatron-core without CUDA: the few shims it needs, and only when CUDA is absent.

megatron-core assumes a GPU in three places a TP=1, PP=1 GPT forward/backward reaches:
its parallel state needs a torch.distributed world, the attention scores come from a global
scratch buffer it allocates on `torch.cuda.current_device()`, and every attention forward
enters `get_cuda_rng_tracker().fork()`, whose states are CUDA generator states. On a CPU host
this module gives megatron a world of one over gloo, a CPU scratch buffer and an RNG tracker
over the CPU generator. With CUDA present nothing here replaces anything: megatron's own
`model_parallel_cuda_manual_seed` runs, exactly as in a megatron training script.

The causal mask is not shimmed: callers pass an explicit CPU mask, so megatron never builds its
default mask on "cuda".
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Iterator
from functools import reduce
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore  # torch.distributed's re-export is untyped


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """Silence what megatron-core says on every host without Transformer Engine or Apex.

    It warns at import and at spec building that those fused kernels are absent (the local spec
    is chosen on purpose), and its own local spec trips its deprecation notices (an MLP built
    from the config's ffn size, linears given the default TP group). None of it is actionable.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.")
        # megatron decorates kernels with torch.jit.script, which torch now deprecates.
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script", category=DeprecationWarning)
        yield


with quiet_megatron():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.utils import GlobalMemoryBuffer

# Offsets megatron's model_parallel_cuda_manual_seed gives its tracked streams at TP rank 0 and
# EP rank 0; mirrored so a CPU run draws from the same named streams a GPU run would.
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_EXPERT_PARALLEL_SEED_OFFSET = 1024


def cpu_shims_active() -> bool:
    """True when megatron-core must run through this module's shims (no usable CUDA device)."""
    return not torch.cuda.is_available()


class CpuMemoryBuffer(GlobalMemoryBuffer):  # type: ignore[misc]
    """megatron's scratch buffer, allocated on the CPU instead of the current CUDA device."""

    def get_tensor(
        self,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], Any] | None = None,
    ) -> torch.Tensor:
        required = reduce(operator.mul, tensor_shape, 1)
        key = (name, dtype)
        buffer: torch.Tensor | None = self.buffer.get(key)
        if buffer is None or buffer.numel() < required:
            buffer = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[key] = buffer
        return buffer[:required].view(*tensor_shape)


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):  # type: ignore[misc]
    """megatron's named RNG streams, kept as CPU generator states (fork swaps the CPU generator)."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"rng state {name!r} was never added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


def _seed_cpu_rng_tracker(seed: int) -> None:
    tracker = CpuRNGStatesTracker()
    tracker.add(megatron_random.get_data_parallel_rng_tracker_name(), seed)
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TENSOR_PARALLEL_SEED_OFFSET)
    tracker.add(megatron_random.get_expert_parallel_rng_tracker_name(), seed + _EXPERT_PARALLEL_SEED_OFFSET)
    # get_cuda_rng_tracker() returns this module global once it is marked initialized.
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def initialize_megatron(seed: int) -> None:
    """Ready megatron-core's global state in this process: TP=1, PP=1, data parallel over the world.

    A process that already joined a torch.distributed group (a trainer rank) keeps it; a lone
    process (tests, the warm start) gets a world of one. Calling it again only reseeds.
    """
    cpu = cpu_shims_active()
    if not dist.is_initialized():
        # A world of one needs no rendezvous: an in-memory store stands in for the TCP one.
        dist.init_process_group("gloo" if cpu else "nccl", store=HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        if cpu:
            # The buffer megatron just made would allocate on torch.cuda.current_device().
            parallel_state._GLOBAL_MEMORY_BUFFER = CpuMemoryBuffer()
    torch.manual_seed(seed)
    if cpu:
        _seed_cpu_rng_tracker(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
