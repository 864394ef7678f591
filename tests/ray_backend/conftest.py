"""One RayBackend per node of the tests' loopback Ray cluster, as its agent would run it; whatever a
test leaves of its jobs (workers, also those a migration started, and drivers) is stopped after."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from agents.backends.ray import driver_client
from agents.backends.ray.actors import job_of, stop_worker
from agents.backends.ray.backend import RayBackend
from tests.ray_cluster import NAMESPACE, LocalRayCluster


@pytest.fixture
def agents(ray_cluster: LocalRayCluster, warm_start_cache: Path) -> Iterator[dict[str, RayBackend]]:
    backends = {
        node: RayBackend(
            node, address=ray_cluster.address, namespace=NAMESPACE, checkpoint_dir=str(warm_start_cache)
        )
        for node in ray_cluster.nodes
    }
    yield backends
    for name in ray.util.list_named_actors():
        node, _, worker_name = name.partition("/")
        if node in backends and job_of(worker_name) is not None:
            stop_worker(node, worker_name)
        elif name.startswith(driver_client.DRIVER_PREFIX):
            driver_client.stop_driver(int(name.removeprefix(driver_client.DRIVER_PREFIX)))
