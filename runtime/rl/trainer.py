"""The `actor`: one data-parallel rank of the GRPO trainer.

Each rank holds the whole megatron-core GPTModel (TP=1, PP=1) wrapped in torch DDP, and an
AdamW optimizer. A step receives the *global* batch on every rank; the rank takes its contiguous
share, splits it into micro-batches, accumulates gradients (DDP's ``no_sync`` on all but the
last micro-batch, so gradients are all-reduced once per step) and steps the optimizer. The loss
of every micro-batch is divided by the global batch's response-token count and multiplied by
the world size (DDP averages gradients over ranks), so the update is the gradient of the global
token mean whatever the world size and micro-batch size: the same global batch gives the same
step at DP=1 and DP=N, up to float summation order.

Process groups. megatron-core's own parallel state stays a world of one in every rank (see
`runtime.model.megatron_compat`): with TP=1 and PP=1 it needs no peers. The data-parallel group
is built separately and explicitly from a store the caller passes in (`DataParallelRendezvous`:
a FileStore or TCPStore, this rank, the world size and a generation name that prefixes the
group's keys). Nothing here depends on a default torch.distributed world, so a later change can
build the DP group of another generation at another size from the same or a new store, re-wrap
``module`` in a new DDP over it and drop the old group, without restarting the process or
touching megatron's state. The backend follows the device: gloo on CPU, NCCL when CUDA is present.
"""

from __future__ import annotations

import datetime
import gc
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d  # stores and backends are untyped in torch.distributed
from torch.nn.parallel import DistributedDataParallel

from runtime.model.megatron_gpt import build_gpt_model, token_logprobs
from runtime.model.weights import engine_to_megatron, megatron_to_engine
from runtime.rl.grpo import (
    GRPOMetrics,
    LossSums,
    Trajectory,
    grpo_loss,
    pack_trajectories,
    trajectory_advantages,
)
from runtime.rl.trainer_config import TrainerConfig


@dataclass(frozen=True)
class DataParallelRendezvous:
    """Everything needed to build one generation of the data-parallel group.

    ``store`` is shared by every rank of the generation (a FileStore on a shared path, or a
    TCPStore whose server rank 0 hosts). ``generation`` prefixes the group's keys, so groups of
    different generations (sizes) can share one store without reading each other's keys.
    """

    store: c10d.Store
    rank: int
    world_size: int
    generation: str = "dp-0"
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of size {self.world_size}")


def training_device() -> torch.device:
    """The current CUDA device when there is one (the caller set CUDA_VISIBLE_DEVICES), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def create_data_parallel_group(rendezvous: DataParallelRendezvous, device: torch.device) -> c10d.ProcessGroup:
    """A process group over the rendezvous' ranks that is not the default torch.distributed world.

    Blocks until every rank joined. torch has no public constructor for a group outside the
    default world, so the backend is built on the store and registered on a ProcessGroup the way
    torch.distributed does internally; DDP and collectives take that object like any group.
    """
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    prefixed = c10d.PrefixStore(f"{rendezvous.generation}/", rendezvous.store)
    group = c10d.ProcessGroup(prefixed, rendezvous.rank, rendezvous.world_size)
    backend: Any
    if device.type == "cuda":
        # Only in CUDA builds of torch, hence looked up rather than imported.
        nccl: Any = c10d.ProcessGroupNCCL  # type: ignore[attr-defined,unused-ignore]
        options = nccl.Options()
        options._timeout = timeout
        backend = nccl(prefixed, rendezvous.rank, rendezvous.world_size, options)
        backend_type = c10d.ProcessGroup.BackendType.NCCL
    else:
        backend = c10d.ProcessGroupGloo(prefixed, rendezvous.rank, rendezvous.world_size, timeout)
        backend_type = c10d.ProcessGroup.BackendType.GLOO
    group._register_backend(device, backend_type, backend)
    group._set_default_backend(backend_type)
    return group


@dataclass(frozen=True)
class TrainStepMetrics:
    """One optimizer step, identical on every rank (token sums are all-reduced)."""

    step: int
    weight_version: str
    grpo: GRPOMetrics
    grad_norm: float
    # Share of trained tokens sampled under an older weight version than the one trained from.
    stale_token_fraction: float
    micro_batches: int
    seconds: float


class Trainer:
    """One data-parallel rank: the model, its DDP wrapper over the DP group, AdamW and a step count."""

    def __init__(
        self,
        config: TrainerConfig,
        rendezvous: DataParallelRendezvous | None,
        initial_weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Build the model (from ``initial_weights`` in the engine's names when given, e.g. the
        warm start's), join the DP group and wrap the model in DDP, which makes every rank start
        from rank 0's parameters.

        Without ``rendezvous`` the rank is built on **standby**: model and optimizer, no group. A
        rank joining a running trainer (a p2p migration, runtime/rl/state_transfer.py) starts so,
        receives the state, and joins the new group with `regroup`."""
        self.config = config
        self.rank = 0
        self.world_size = 0
        self.device = training_device()
        self.module = build_gpt_model(config.model, seed=config.seed)
        if initial_weights is not None:
            # strict=False only because megatron lists `_extra_state` entries that carry nothing.
            result = self.module.load_state_dict(
                engine_to_megatron(initial_weights, config.model), strict=False
            )
            missing = [name for name in result.missing_keys if not name.endswith("_extra_state")]
            if missing:
                raise ValueError(f"initial weights lack {missing}")
        # Training mode for good (no dropout is configured; this only keeps megatron's mode right).
        self.module.train()
        self.module.to(self.device)
        self.group: c10d.ProcessGroup | None = None
        self.model: DistributedDataParallel | None = None
        self.generation = ""
        self._prepared: tuple[DataParallelRendezvous, c10d.ProcessGroup] | None = None
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(),
            lr=config.learning_rate,
            betas=config.adam_betas,
            weight_decay=config.weight_decay,
        )
        self.step = 0
        if rendezvous is not None:
            self.regroup(rendezvous)

    def regroup(self, rendezvous: DataParallelRendezvous) -> None:
        """Join the data-parallel group of ``rendezvous`` (a new generation, at its size), leaving
        the current one: `prepare_group` then `switch_group`."""
        self.prepare_group(rendezvous)
        self.switch_group()

    def prepare_group(self, rendezvous: DataParallelRendezvous) -> None:
        """Build the group of a new generation beside the current one, which keeps training until
        `switch_group` (a p2p migration's ``rebuild_groups``; `drop_prepared_group` undoes it).
        The global batch stays the same and is split over the new world size, so it must divide."""
        if self.config.global_batch_size % rendezvous.world_size:
            raise ValueError(
                f"global batch of {self.config.global_batch_size} does not split over "
                f"{rendezvous.world_size} ranks"
            )
        self._prepared = (rendezvous, create_data_parallel_group(rendezvous, self.device))

    def drop_prepared_group(self) -> None:
        self._prepared = None

    @property
    def prepared_generation(self) -> str | None:
        return None if self._prepared is None else self._prepared[0].generation

    def switch_group(self) -> None:
        """Train in the prepared group from now on (all its ranks call this together: DDP's
        start-up broadcast from its rank 0 finds the weights equal everywhere after a state
        transfer); the optimizer and the weights are untouched."""
        if self._prepared is None:
            raise RuntimeError("no data-parallel group is prepared to switch to")
        rendezvous, group = self._prepared
        self._prepared = None
        self.leave_group()
        self.group = group
        self.rank = rendezvous.rank
        self.world_size = rendezvous.world_size
        self.generation = rendezvous.generation
        self.model = DistributedDataParallel(
            self.module,
            process_group=group,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
        )

    def leave_group(self) -> None:
        """Drop the DDP wrapper (its reducer's gradient hooks go with it), then the group. A
        trainer in a group calls this before it is dropped (``close``)."""
        self.model = None
        self.generation = ""
        # The old reducer must be gone before a new DDP hooks the same parameters, and it must go
        # while this trainer still holds the group. A reducer left with the group's last reference
        # destroys it holding the GIL, and gloo's destructor joins its worker threads, one of
        # which may be waiting for the GIL to free a finished all-reduce's tensors: a deadlock.
        gc.collect()
        # The group's own binding releases the GIL while gloo's threads finish.
        self.group = None

    def close(self) -> None:
        """Leave the current group and drop a prepared one (see ``leave_group``)."""
        self.leave_group()
        self.drop_prepared_group()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _joined(self) -> tuple[DistributedDataParallel, c10d.ProcessGroup]:
        if self.model is None or self.group is None:
            raise RuntimeError("this trainer rank is on standby: it has no data-parallel group yet")
        return self.model, self.group

    @property
    def weight_version(self) -> str:
        """The version the current weights carry: the number of optimizer steps taken."""
        return str(self.step)

    def local_samples(self, samples: Sequence[Trajectory]) -> Sequence[Trajectory]:
        """This rank's contiguous share of the global batch."""
        share = len(samples) // self.world_size
        return samples[self.rank * share : (self.rank + 1) * share]

    def micro_batches(self, samples: Sequence[Trajectory]) -> Iterator[tuple[int, int]]:
        """[start, end) indices of this rank's micro-batches within its share."""
        size = self.config.micro_batch_size
        for start in range(0, len(samples), size):
            yield start, min(start + size, len(samples))

    def train_step(self, samples: Sequence[Trajectory]) -> TrainStepMetrics:
        """One GRPO optimizer step on the global batch ``samples`` (the same list on every rank)."""
        if len(samples) != self.config.global_batch_size:
            raise ValueError(
                f"expected a global batch of {self.config.global_batch_size}, got {len(samples)}"
            )
        model, _ = self._joined()
        started = time.perf_counter()
        grpo = self.config.grpo
        need_reference = grpo.kl_coef > 0
        # Advantages and the loss normaliser come from the whole global batch, which every rank
        # holds, so no communication is needed for them and groups may straddle ranks.
        advantages = trajectory_advantages(samples, grpo.advantage_eps)
        global_tokens = float(sum(t.trained_tokens for t in samples))
        share = self.local_samples(samples)
        share_offset = self.rank * len(share)
        bounds = list(self.micro_batches(share))

        self.optimizer.zero_grad(set_to_none=True)
        sums = LossSums(0.0, 0.0, 0.0, 0.0, 0.0)
        stale_tokens = 0
        for index, (start, end) in enumerate(bounds):
            micro = share[start:end]
            batch = pack_trajectories(
                micro,
                advantages[share_offset + start : share_offset + end],
                self.config.pad_id,
                need_reference,
            )
            stale_tokens += sum(
                version != self.weight_version
                for t in micro
                for version, trained in zip(t.weight_versions, t.trained_mask, strict=True)
                if trained
            )
            last = index == len(bounds) - 1
            sync: AbstractContextManager[None] = nullcontext() if last else model.no_sync()
            with sync:
                new_logprobs = token_logprobs(model, batch.input_ids, batch.targets)
                loss, micro_sums = grpo_loss(
                    new_logprobs,
                    batch.sampling_logprobs.to(self.device),
                    batch.reference_logprobs.to(self.device),
                    batch.advantages.to(self.device),
                    batch.response_mask.to(self.device),
                    grpo,
                    token_normaliser=global_tokens,
                )
                # DDP averages gradients over ranks; the loss is a sum over the global batch.
                torch.autograd.backward(loss * self.world_size)
            sums = sums + micro_sums
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.step += 1

        totals = torch.cat([sums.as_tensor(), torch.tensor([float(stale_tokens)], dtype=torch.float64)])
        totals = self._all_reduce_sum(totals)
        global_sums = LossSums.from_tensor(totals[:5])
        mean_reward = sum(t.reward for t in samples) / len(samples)
        return TrainStepMetrics(
            step=self.step,
            weight_version=self.weight_version,
            grpo=GRPOMetrics.from_sums(global_sums, mean_reward),
            grad_norm=float(grad_norm),
            stale_token_fraction=float(totals[5]) / max(global_sums.tokens, 1.0),
            micro_batches=len(bounds),
            seconds=time.perf_counter() - started,
        )

    def _all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        _, group = self._joined()
        on_device = values.to(self.device)
        group.allreduce([on_device]).wait()
        return on_device.cpu()

    @torch.no_grad()
    def response_logprobs(self, samples: Sequence[Trajectory]) -> list[list[float]]:
        """The current policy's log-probability of each response token (no gradient, no DDP)."""
        return response_logprobs(self.module, samples, self.config.pad_id)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The current weights in the rollout engine's names, as detached copies on this device."""
        return megatron_to_engine(self.module.state_dict(), self.config.model)


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module, samples: Sequence[Trajectory], pad_id: int
) -> list[list[float]]:
    """``model``'s log-probability of each response token of each sample, batched with padding."""
    batch = pack_trajectories(samples, torch.zeros(len(samples)), pad_id, need_reference=False)
    logprobs = token_logprobs(model, batch.input_ids, batch.targets).cpu()
    return [row[mask].tolist() for row, mask in zip(logprobs, batch.response_mask, strict=True)]
