"""The trainer's ranks as Ray actors (see ``agents.backends.ray.actors`` for how a node's workers
are named, pinned and given their devices). Only the trainer's processes import this module, and
with it megatron-core: the engines' and the reward's start without it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d  # torch.distributed's stores are untyped there

from agents.backends.ray.actors import Usage, WorkerUsage, free_port, node_ip
from runtime.engine.client import EngineClient
from runtime.engine.weight_sync import DEFAULT_GROUP_NAME
from runtime.rl.checkpoint import load_trainer_state, save_trainer_state
from runtime.rl.grpo import Trajectory
from runtime.rl.state_transfer import TransferRendezvous, abandon_transfer, state_checksums, transfer_state
from runtime.rl.trainer import DataParallelRendezvous, Trainer, TrainStepMetrics
from runtime.rl.trainer_config import TrainerConfig
from runtime.rl.weight_push import WeightPusher, weight_update_backend


class TrainerRankWorker:
    """One data-parallel rank of the trainer. Started by its agent as an empty rank; the job's
    driver then has rank 0 host the TCP store (``host_store``) and every rank ``join`` it, which
    builds the model from the warm-start checkpoint and the data-parallel group.

    A rank started by a p2p migration goes on ``standby`` instead (model and optimizer, no group),
    receives the running trainer's state (``transfer``, runtime/rl/state_transfer.py), and trains
    once the driver has every rank of the new layout ``prepare`` the next generation's group and
    ``switch`` to it; ranks the new layout leaves out ``leave``."""

    def __init__(self, config: TrainerConfig) -> None:
        torch.set_num_threads(1)
        self._config = config
        self._stores: dict[str, c10d.Store] = {}  # by address: the ones this rank serves or joined
        self._trainer: Trainer | None = None
        self._pusher: WeightPusher | None = None
        self._usage = Usage()

    def host_store(self, world_size: int) -> str:
        """Serve a rendezvous store on a free port of this node (rank 0 of a generation does);
        returns ``host:port``. It is served for as long as this rank lives."""
        host = node_ip()
        store = c10d.TCPStore(host, 0, world_size, True, wait_for_workers=False)
        address = f"{host}:{store.port}"
        self._stores[address] = store
        return address

    def _store_at(self, address: str, world_size: int) -> c10d.Store:
        if address not in self._stores:
            host, _, port = address.rpartition(":")
            self._stores[address] = c10d.TCPStore(host, int(port), world_size, False)
        return self._stores[address]

    def join(
        self,
        store_address: str,
        rank: int,
        world_size: int,
        generation: str,
        initial_weights: Mapping[str, torch.Tensor] | None,
    ) -> int:
        """Build the model (from ``initial_weights``, in the engine's names) and join the DP group;
        returns once every rank joined."""
        store = self._store_at(store_address, world_size)
        rendezvous = DataParallelRendezvous(store, rank, world_size, generation)
        self._trainer = Trainer(self._config, rendezvous, initial_weights)
        return self._trainer.rank

    def _joined(self) -> Trainer:
        if self._trainer is None:
            raise ValueError("this trainer rank has not joined its data-parallel group yet")
        return self._trainer

    # -- a re-placement of the job ------------------------------------------------------------------

    def keep_state(self, path: str, cursor: Mapping[str, Any]) -> dict[str, Any]:
        """Write this rank's whole state and ``cursor`` to ``path`` (runtime/rl/checkpoint.py)
        before the job's workers stop to be placed anew."""
        kept = save_trainer_state(self._joined(), Path(path), cursor)
        return {"path": str(kept.path), "step": kept.step, "bytes": kept.bytes}

    def resume_state(self, path: str) -> dict[str, Any]:
        """Load the state a trainer of the job kept at ``path``; returns its step and cursor."""
        kept = load_trainer_state(self._joined(), Path(path))
        return {"step": kept.step, "cursor": dict(kept.cursor), "bytes": kept.bytes}

    # -- a p2p migration --------------------------------------------------------------------------

    def standby(self) -> None:
        """A new rank: build the model and optimizer, join no group (idempotent)."""
        if self._trainer is None:
            self._trainer = Trainer(self._config, None)

    def transfer(
        self, store_address: str, rank: int, world_size: int, prefix: str, cursor: Mapping[str, Any]
    ) -> dict[str, Any]:
        """This rank's part of a state transfer: rank 0 (a rank of the running trainer) sends,
        the others (on standby) receive. Returns what moved and the state's checksums after."""
        trainer = self._joined()
        rendezvous = TransferRendezvous(self._store_at(store_address, world_size), rank, world_size, prefix)
        report = transfer_state(trainer, rendezvous, cursor)
        return {
            "bytes": report.bytes,
            "seconds": report.seconds,
            "step": report.step,
            "cursor": dict(report.cursor),
            "checksums": state_checksums(trainer),
        }

    def abandon_transfer(self, store_address: str, world_size: int, prefix: str, why: str) -> None:
        """Give up the transfer under ``prefix`` (its ranks still checking in raise at once)."""
        abandon_transfer(self._store_at(store_address, world_size), prefix, why)

    def prepare(self, store_address: str, rank: int, world_size: int, generation: str) -> None:
        """Build the next generation's DP group beside the current one."""
        store = self._store_at(store_address, world_size)
        self._joined().prepare_group(DataParallelRendezvous(store, rank, world_size, generation))

    def drop_prepared(self) -> None:
        if self._trainer is not None:
            self._trainer.drop_prepared_group()

    def switch(self) -> int:
        """Train in the prepared group (every rank of it calls this together); returns the rank."""
        trainer = self._joined()
        trainer.switch_group()
        return trainer.rank

    def leave(self) -> None:
        """Out of the new layout: drop the group and the weight push (the actor is then stopped)."""
        self.close_pusher()
        if self._trainer is not None:
            self._trainer.leave_group()

    def generation(self) -> str:
        return "" if self._trainer is None else self._trainer.generation

    def checksums(self) -> dict[str, str]:
        return state_checksums(self._joined())

    def rank(self) -> int:
        return self._joined().rank

    def train_step(self, samples: Sequence[Trajectory]) -> TrainStepMetrics:
        trainer = self._joined()
        started = self._usage.begin()
        metrics = trainer.train_step(samples)
        local = trainer.local_samples(samples)
        self._usage.end(started, tokens=sum(len(s.prompt_ids) + len(s.response_ids) for s in local))
        return metrics

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return self._joined().engine_weights()

    def weight_version(self) -> str:
        return self._joined().weight_version

    def response_logprobs(self, samples: Sequence[Trajectory]) -> list[list[float]]:
        return self._joined().response_logprobs(samples)

    def connect_engines(self, engine_urls: Sequence[str], group_name: str = DEFAULT_GROUP_NAME) -> None:
        """Rank 0: host the weight-update group ``group_name`` of the rollout engines at
        ``engine_urls`` on a free port of this node (a new rank 0 after a p2p migration opens one
        under a new name: the engines may still hold the old rank 0's)."""
        if self._joined().rank != 0:
            raise ValueError("only data-parallel rank 0 pushes weights to the engines")
        self.close_pusher()
        infos = []
        for url in engine_urls:
            with EngineClient(url) as client:
                infos.append(client.server_info())
        backend = weight_update_backend(self._joined().device, infos)
        self._pusher = WeightPusher(
            engine_urls, node_ip(), free_port(), group_name=group_name, backend=backend
        )

    def close_pusher(self) -> None:
        pusher, self._pusher = self._pusher, None
        if pusher is not None:
            pusher.close()

    def push_weights(self) -> str:
        """Rank 0: send the current weights to every engine; returns their weight version."""
        if self._pusher is None:
            raise ValueError("connect_engines first")
        trainer = self._joined()
        self._pusher.push(trainer.engine_weights(), trainer.weight_version)
        return trainer.weight_version

    def usage(self) -> WorkerUsage:
        return self._usage.reading()
