"""A node's workers as Ray actors pinned to that node, holding the devices the control plane gave.

Every worker is a named, detached actor (``<node>/<worker>`` in the agent's namespace): it outlives
an agent restart, and the agent finds its node's workers again by name. Placement is the control
plane's, not Ray's: the actor is pinned to this agent's Ray node (``NodeAffinitySchedulingStrategy``,
not soft) and sees exactly its assigned devices through ``CUDA_VISIBLE_DEVICES``, which we set and
Ray is told to leave alone. Ray still counts the GPUs a worker holds alone (``num_gpus``), so other
Ray work does not land on them; devices a worker time-shares with others of its job (a colocated
placement) are counted by none of them.

Worker kinds are added as the runtime grows: ``CpuEngineWorker`` serves a rollout engine, the CPU
stand-in for an SGLang server (``runtime.engine``); ``TrainerRankWorker`` is one data-parallel rank
of the trainer (``runtime.rl.trainer``), joining its peers through a TCP store that rank 0 hosts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, Final

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from torch._C import _distributed_c10d as c10d  # torch.distributed's stores are untyped there

from agents.backends.ray.connection import RayNode
from runtime.engine.cpu_engine import CpuEngine, EngineSettings
from runtime.engine.cpu_server import CpuEngineServer
from runtime.model.config import GPTConfig
from runtime.rl.grpo import Trajectory
from runtime.rl.trainer import DataParallelRendezvous, Trainer, TrainerConfig, TrainStepMetrics
from runtime.rl.weight_push import WeightPusher

# Ray sets CUDA_VISIBLE_DEVICES to the GPU ids it picked unless told not to.
KEEP_OUR_DEVICES: Final = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def actor_name(node: str, worker: str) -> str:
    return f"{node}/{worker}"


def actor_options(node: RayNode, worker: str, devices: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Ray options for ``worker`` on ``node`` with its ``devices`` (the launch payload's entries:
    ``index`` on the host, ``shared`` when time-shared)."""
    visible = ",".join(str(int(d["index"])) for d in devices)
    exclusive = sum(1 for d in devices if not d.get("shared"))
    return {
        "name": actor_name(node.name, worker),
        "lifetime": "detached",
        "max_restarts": 0,  # a worker that dies is reported lost; the control plane decides what next
        "num_cpus": 0,  # CPU threads are each worker's own (one torch thread on CPU hosts)
        "num_gpus": exclusive,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        "runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": visible, **KEEP_OUR_DEVICES}},
    }


class CpuEngineWorker:
    """A rollout engine worker: the CPU stand-in for an SGLang server, serving SGLang's HTTP
    protocol on a free loopback port of its node."""

    def __init__(self, config_json: str, settings: Mapping[str, Any]) -> None:
        torch.set_num_threads(1)
        self._engine = CpuEngine(GPTConfig.from_json(config_json), EngineSettings(**settings))
        self._server = CpuEngineServer(self._engine)
        self._url = self._server.start()

    def url(self) -> str:
        return self._url

    def visible_devices(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())


class TrainerRankWorker:
    """One data-parallel rank of the trainer. Rank 0 hosts the TCP store at ``store_address``
    (its node's address and a port free there); the others connect to it. Creating the ranks
    returns at once; ``ready`` answers once every rank has joined the group."""

    def __init__(
        self, config: TrainerConfig, store_address: str, rank: int, world_size: int, generation: str
    ) -> None:
        torch.set_num_threads(1)
        host, _, port = store_address.rpartition(":")
        store = c10d.TCPStore(host, int(port), world_size, rank == 0)
        rendezvous = DataParallelRendezvous(store, rank, world_size, generation)
        self._store = store  # rank 0 serves the others' rendezvous for as long as it lives
        self._trainer = Trainer(config, rendezvous)
        self._pusher: WeightPusher | None = None

    def ready(self) -> int:
        return self._trainer.rank

    def train_step(self, samples: Sequence[Trajectory]) -> TrainStepMetrics:
        return self._trainer.train_step(samples)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        return self._trainer.engine_weights()

    def response_logprobs(self, samples: Sequence[Trajectory]) -> list[list[float]]:
        return self._trainer.response_logprobs(samples)

    def connect_engines(self, engine_urls: Sequence[str], master_address: str, master_port: int) -> None:
        """Rank 0: host the weight-update group of the rollout engines at ``engine_urls``."""
        if self._trainer.rank != 0:
            raise ValueError("only data-parallel rank 0 pushes weights to the engines")
        self._pusher = WeightPusher(engine_urls, master_address, master_port)

    def push_weights(self) -> str:
        """Rank 0: send the current weights to every engine; returns their weight version."""
        if self._pusher is None:
            raise ValueError("connect_engines first")
        self._pusher.push(self._trainer.engine_weights(), self._trainer.weight_version)
        return self._trainer.weight_version


def start_trainer_rank(
    node: RayNode,
    worker: str,
    devices: Sequence[Mapping[str, Any]],
    config: TrainerConfig,
    *,
    store_address: str,
    rank: int,
    world_size: int,
    generation: str = "dp-0",
) -> Any:
    """Start rank ``rank`` of the trainer as ``worker`` on ``node``; returns its actor handle
    (``ready`` once every rank joined)."""
    actor_class = ray.remote(TrainerRankWorker)
    return actor_class.options(**actor_options(node, worker, devices)).remote(
        config, store_address, rank, world_size, generation
    )


def start_engine_worker(
    node: RayNode,
    worker: str,
    devices: Sequence[Mapping[str, Any]],
    config: GPTConfig,
    settings: EngineSettings,
    *,
    timeout_s: float = 60.0,
) -> str:
    """Start ``worker``'s engine on ``node``; returns its URL once it serves."""
    actor_class = ray.remote(CpuEngineWorker)
    handle: Any = actor_class.options(**actor_options(node, worker, devices)).remote(
        config.to_json(), asdict(settings)
    )
    return str(ray.get(handle.url.remote(), timeout=timeout_s))


def worker_handle(node: str, worker: str) -> Any | None:
    """The live actor of ``worker`` on ``node``, or None."""
    try:
        return ray.get_actor(actor_name(node, worker))
    except ValueError:
        return None


def node_workers(node: str) -> list[str]:
    """The workers whose actors live on ``node`` (by name, in the agent's namespace)."""
    prefix = f"{node}/"
    return sorted(name[len(prefix) :] for name in ray.util.list_named_actors() if name.startswith(prefix))


def stop_worker(node: str, worker: str, *, timeout_s: float = 30.0) -> bool:
    """End ``worker``'s actor; False when it was not running. Returns once its name is free."""
    handle = worker_handle(node, worker)
    if handle is None:
        return False
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while worker in node_workers(node):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the actor of {worker} on {node} still exists {timeout_s:g} s after it was killed"
            )
        time.sleep(0.05)  # Ray frees the name asynchronously and offers no event to wait on
    return True
