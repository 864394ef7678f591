"""One local Ray cluster per test session, shared by every test that asks for ``ray_cluster``
(the ray backend's tests and the live stack's real jobs): two nodes on loopback (``node-a``,
``node-b``), four logical GPUs each (``num_gpus`` is a resource label here; no device is needed),
one CPU each (the machine has two). Its processes are children of the test process and end with
the session. Registered as a plugin by tests/conftest.py, after the loopback environment is set."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from agents.backends.ray.local_cluster import start_local_cluster

NODE_GPUS = 4
NAMESPACE = "dynarl-test"  # the tests' named actors, the agents' included


@dataclass(frozen=True)
class LocalRayCluster:
    address: str  # the GCS, host:port
    nodes: tuple[str, ...]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    nodes = ("node-a", "node-b")
    cluster = start_local_cluster(nodes, gpus=NODE_GPUS)
    try:
        yield LocalRayCluster(address=cluster.address, nodes=nodes)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def warm_start_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint directory the session's real jobs share: a warm start is cached there under
    its model, SFT settings and seed (``runtime.rl.warm_start.warm_start_cache_key``), so the first job of
    a shape computes it and the others load it, as jobs sharing a node's directory do."""
    return tmp_path_factory.mktemp("checkpoints")
