"""A whole RL job in this process: rollout engines and a reference engine served over HTTP on
loopback ports, a trainer of world size one joined through a FileStore, and the weight pusher
between them. Everything is the real thing; only the placement (one process) is a test's."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._C import _distributed_c10d as c10d

from runtime.engine.client import EngineClient
from runtime.engine.cpu_engine import CpuEngine
from runtime.engine.cpu_server import CpuEngineServer
from runtime.engine.model import gpt_from_weights
from runtime.rl.job import RLJobConfig
from runtime.rl.loop import EngineReference, ExactMatchReward, InProcessTrainerGroup
from runtime.rl.trainer import DataParallelRendezvous, Trainer
from runtime.rl.weight_push import WeightPusher

TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class LocalJob:
    config: RLJobConfig
    engines: list[EngineClient]
    reference_engine: EngineClient
    reference: EngineReference
    reward: ExactMatchReward
    trainer: Trainer
    group: InProcessTrainerGroup
    servers: list[CpuEngineServer]


def serve_engine(
    stack: ExitStack, config: RLJobConfig, weights: Mapping[str, torch.Tensor], max_running_requests: int
) -> tuple[CpuEngineServer, EngineClient]:
    engine = CpuEngine(
        config.model,
        config.engine_settings(max_running_requests=max_running_requests),
        model=gpt_from_weights(config.model, weights),
    )
    server = CpuEngineServer(engine, port=0)
    server.start()
    stack.callback(server.stop)
    client = EngineClient(server.url, timeout_s=TIMEOUT_S, generate_timeout_s=TIMEOUT_S)
    stack.callback(client.close)
    return server, client


@contextmanager
def local_job(
    config: RLJobConfig,
    weights: Mapping[str, torch.Tensor],
    rollout_engines: int = 2,
    max_running_requests: int = 64,
) -> Iterator[LocalJob]:
    """Start the job's parts from the warm-start ``weights``; everything stops on exit."""
    with ExitStack() as stack:
        served = [serve_engine(stack, config, weights, max_running_requests) for _ in range(rollout_engines)]
        reference_server, reference_client = serve_engine(stack, config, weights, max_running_requests)
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rl-job-")))
        rendezvous = DataParallelRendezvous(
            store=c10d.FileStore(str(scratch / "store"), 1), rank=0, world_size=1, timeout_s=TIMEOUT_S
        )
        trainer = Trainer(config.trainer_config(), rendezvous, initial_weights=weights)
        stack.callback(trainer.close)
        pusher = WeightPusher(
            [server.url for server, _ in served], "127.0.0.1", free_port(), timeout_s=TIMEOUT_S
        )
        stack.callback(pusher.close)
        yield LocalJob(
            config=config,
            engines=[client for _, client in served],
            reference_engine=reference_client,
            reference=EngineReference([reference_client]),
            reward=ExactMatchReward(),
            trainer=trainer,
            group=InProcessTrainerGroup(trainer, pusher),
            servers=[server for server, _ in served] + [reference_server],
        )
