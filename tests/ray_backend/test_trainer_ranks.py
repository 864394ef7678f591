"""The trainer's data-parallel ranks run as Ray actors on two nodes, join one gloo group through
rank 0's TCP store, and take the same optimizer step on the same global batch."""

from __future__ import annotations

import socket

import ray
import torch

from agents.backends.ray.actors import start_trainer_rank, stop_worker
from agents.backends.ray.connection import connect, find_node
from tests.ray_backend.conftest import LocalRayCluster
from tests.runtime.rl.batches import grpo_batch, trainer_config


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_two_ranks_on_two_nodes_train_in_step(ray_cluster: LocalRayCluster) -> None:
    connect(ray_cluster.address, namespace="dynarl-test")
    batch = grpo_batch(groups=2, per_group=4, seed=3, logprob_noise=0.05)
    config = trainer_config(global_batch_size=len(batch), micro_batch_size=2)
    store = f"127.0.0.1:{free_port()}"
    ranks = [
        start_trainer_rank(
            find_node(node),
            f"j1-actor-w{rank}",
            [{"index": rank, "shared": False}],
            config,
            store_address=store,
            rank=rank,
            world_size=2,
        )
        for rank, node in enumerate(("node-a", "node-b"))
    ]
    try:
        assert ray.get([r.ready.remote() for r in ranks], timeout=120) == [0, 1]
        before = ray.get(ranks[0].engine_weights.remote(), timeout=60)
        metrics = ray.get([r.train_step.remote(batch) for r in ranks], timeout=120)
        weights = ray.get([r.engine_weights.remote() for r in ranks], timeout=60)
    finally:
        for rank, node in enumerate(("node-a", "node-b")):
            stop_worker(node, f"j1-actor-w{rank}")
    assert metrics[0].grpo == metrics[1].grpo and metrics[0].step == metrics[1].step == 1
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert any(not torch.equal(before[name], weights[0][name]) for name in before)
