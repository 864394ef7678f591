"""The trainer's weights going to the rollout engines after every step, through the engines' own
routes (SGLang's ``/init_weights_update_group`` and ``/update_weights_from_distributed``).

Trainer rank 0 hosts a weight-update group of ``1 + len(engines)`` ranks, itself rank 0 and each
engine at its ``rank_offset``; a push announces names, dtypes and shapes to every engine over HTTP
and then broadcasts the tensors in that order. Both sides block until the other has done its
part, so the HTTP calls run on threads while this thread hosts the group or broadcasts. The
engines report the pushed ``weight_version`` back (``/server_info``, and per generated token).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

from runtime.engine.client import EngineClient, EngineError
from runtime.engine.cpu_server import ENGINE_NAME
from runtime.engine.weight_sync import (
    DEFAULT_GROUP_NAME,
    WeightUpdateGroup,
    broadcast_from_trainer,
    create_weight_update_group,
    dtype_name,
    release_weight_update_group,
)
from runtime.model.checkpoint import engine_to_hf

T = TypeVar("T")


def weight_update_backend(device: torch.device, engine_infos: Sequence[Mapping[str, object]]) -> str:
    """The weight-update group's backend: NCCL when the trainer's weights are on a CUDA device and
    every engine is a GPU server (SGLang), gloo otherwise (the CPU stand-in, or a CPU trainer)."""
    if device.type == "cuda" and all(info.get("engine") != ENGINE_NAME for info in engine_infos):
        return "nccl"
    return "gloo"


class WeightPusher:
    """Rank 0's end of the weight-update group to ``engine_urls`` (one rank per engine)."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        master_address: str,
        master_port: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        if not engine_urls:
            raise ValueError("a weight push needs at least one engine")
        self.group_name = group_name
        self.backend = backend
        self.timeout_s = timeout_s
        self.clients = [
            EngineClient(url, timeout_s=timeout_s, generate_timeout_s=timeout_s) for url in engine_urls
        ]
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="weight-push")
        world_size = 1 + len(self.clients)
        joins = self._on_every_engine(
            lambda offset, client: client.init_weights_update_group(
                master_address, master_port, offset, world_size, group_name, backend
            )
        )
        self.group: WeightUpdateGroup = create_weight_update_group(
            master_address, master_port, 0, world_size, group_name, backend, timeout_s
        )
        self._wait(joins)

    def push(self, weights: Mapping[str, torch.Tensor], weight_version: str) -> None:
        """Send ``weights`` (the engine's names) to every engine under the checkpoint's names (the
        ones SGLang's model loader takes, see runtime/model/checkpoint.py); each engine then
        reports ``weight_version``. Returns once every engine has loaded them."""
        named = engine_to_hf(weights)
        names = list(named)
        # Over gloo the tensors travel from host memory; over NCCL they stay on the device.
        on_host = self.backend == "gloo"
        tensors = [named[name].cpu() if on_host else named[name] for name in names]
        dtypes = [dtype_name(t.dtype) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        updates = self._on_every_engine(
            lambda _, client: client.update_weights_from_distributed(
                names, dtypes, shapes, self.group_name, weight_version
            )
        )
        broadcast_from_trainer(self.group, tensors)
        self._wait(updates)

    def close(self) -> None:
        """Leave the group, and ask every engine that still answers to leave it too (another
        trainer rank may open a group of its own on them next)."""
        release_weight_update_group(self.group)
        for client in self.clients:
            # An engine that is gone, or already left, holds nothing to undo.
            with contextlib.suppress(EngineError, OSError):
                client.destroy_weights_update_group(self.group_name)
            client.close()
        self._pool.shutdown(wait=False)

    def _on_every_engine(self, call: Callable[[int, EngineClient], T]) -> list[Future[T]]:
        # Engine i is rank i + 1 of the group: the trainer is rank 0.
        return [self._pool.submit(call, offset, client) for offset, client in enumerate(self.clients, 1)]

    def _wait(self, futures: Sequence[Future[T]]) -> list[T]:
        return [future.result(timeout=self.timeout_s) for future in futures]
