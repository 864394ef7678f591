"""The trainer's data-parallel ranks run as Ray actors on two nodes, join one gloo group through
rank 0's TCP store, and take the same optimizer step on the same global batch."""

from __future__ import annotations

from typing import Any

import ray
import torch

from agents.backends.ray.actors import start_engine_worker, start_worker_actor, stop_worker
from agents.backends.ray.connection import connect, find_node
from agents.backends.ray.trainer_rank import TrainerRankWorker
from runtime.engine.client import EngineClient
from runtime.engine.cpu_engine import EngineSettings
from runtime.rl.grpo import Trajectory
from runtime.rl.trainer_config import TrainerConfig
from tests.ray_cluster import NAMESPACE, LocalRayCluster
from tests.runtime.rl.batches import TINY, grpo_batch, trainer_config


def start_ranks(job: int, nodes: tuple[str, ...], config: TrainerConfig) -> list[Any]:
    """The trainer's ranks as their agents start them, then joined as the job's driver does:
    rank 0 hosts the store on its node, every rank joins it."""
    ranks = [
        start_worker_actor(
            find_node(node),
            f"j{job}-actor-w{rank}",
            [{"index": rank, "shared": False}],
            TrainerRankWorker,
            config,
        )
        for rank, node in enumerate(nodes)
    ]
    store = ray.get(ranks[0].host_store.remote(len(ranks)), timeout=120)
    joined = ray.get(
        [r.join.remote(store, i, len(ranks), "dp-0", None) for i, r in enumerate(ranks)], timeout=120
    )
    assert joined == list(range(len(ranks)))
    return ranks


def test_two_ranks_on_two_nodes_train_in_step(ray_cluster: LocalRayCluster) -> None:
    connect(ray_cluster.address, namespace=NAMESPACE)
    batch = grpo_batch(groups=2, per_group=4, seed=3, logprob_noise=0.05)
    config = trainer_config(global_batch_size=len(batch), micro_batch_size=2)
    ranks = start_ranks(1, ("node-a", "node-b"), config)
    try:
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


def test_the_trainer_pushes_its_weights_to_engines_on_other_nodes_which_then_generate_with_them(
    ray_cluster: LocalRayCluster,
) -> None:
    connect(ray_cluster.address, namespace=NAMESPACE)
    batch = grpo_batch(groups=2, per_group=2, seed=5, logprob_noise=0.05)
    config = trainer_config(global_batch_size=len(batch), micro_batch_size=2)
    [trainer] = start_ranks(2, ("node-a",), config)
    # The engines start from other weights (their own seed) than the trainer's.
    urls = [
        start_engine_worker(
            find_node(node),
            f"j2-rollout-w{i}",
            [{"index": 1, "shared": False}],
            TINY,
            EngineSettings(seed=100 + i),
        )
        for i, node in enumerate(("node-a", "node-b"))
    ]
    try:
        ray.get(trainer.train_step.remote(batch), timeout=120)
        ray.get(trainer.connect_engines.remote(urls), timeout=120)
        assert ray.get(trainer.push_weights.remote(), timeout=120) == "1"
        prompt = list(batch[0].prompt_ids)
        for url in urls:
            client = EngineClient(url)
            assert client.weight_version() == "1"
            result = client.generate(
                prompt, {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7}, return_logprob=True
            )
            assert set(result.token_weight_versions()) == {"1"}
            sample = Trajectory(
                prompt_ids=tuple(prompt),
                response_ids=tuple(result.output_ids),
                sampling_logprobs=tuple(result.output_logprobs),
                weight_versions=("1",) * len(result.output_ids),
                reward=0.0,
                group_id="check",
            )
            [trained] = ray.get(trainer.response_logprobs.remote([sample]), timeout=60)
            # The engine's own forward on the pushed weights gives the trainer's log-probs.
            assert torch.allclose(torch.tensor(result.output_logprobs), torch.tensor(trained), atol=1e-4)
            # As an `inference` worker it scores a whole response the same way (reference log-probs).
            scored = client.input_logprobs([*prompt, *result.output_ids], start=len(prompt))
            assert scored.token_ids == result.output_ids and scored.weight_version == "1"
            assert torch.allclose(torch.tensor(scored.logprobs), torch.tensor(trained), atol=1e-4)
    finally:
        stop_worker("node-a", "j2-actor-w0")
        for i, node in enumerate(("node-a", "node-b")):
            stop_worker(node, f"j2-rollout-w{i}")
