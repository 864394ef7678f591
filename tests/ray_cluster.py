"""One local Ray cluster per test session, shared by every test that asks for ``ray_cluster``
(the ray backend's tests and the live stack's real jobs): two nodes on loopback (``node-a``,
``node-b``), four logical GPUs each (``num_gpus`` is a resource label here; no device is needed),
one CPU each (the machine has two). Its processes are children of the test process and end with
the session. Registered as a plugin by tests/conftest.py, after the loopback environment is set."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from agents.backends.ray import LOOPBACK_ENV

NODE_GPUS = 4
NAMESPACE = "dynarl-test"  # the tests' named actors, the agents' included


@dataclass(frozen=True)
class LocalRayCluster:
    address: str  # the GCS, host:port
    nodes: tuple[str, ...]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    assert all(os.environ.get(name) == value for name, value in LOOPBACK_ENV.items()), (
        "tests/conftest.py sets the loopback environment before Ray is imported"
    )
    common: dict[str, Any] = {"num_cpus": 1, "num_gpus": NODE_GPUS, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(
        initialize_head=True, head_node_args={**common, "node_name": "node-a", "include_dashboard": False}
    )
    try:
        cluster.add_node(**common, node_name="node-b")
        cluster.wait_for_nodes()
        yield LocalRayCluster(address=cluster.address, nodes=("node-a", "node-b"))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
