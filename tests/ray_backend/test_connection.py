"""An agent joins the Ray cluster, finds its own node by name, and fails at once with a clear
error when the cluster is not there or its node is not in it."""

from __future__ import annotations

import socket
import time

import pytest

from agents.backends.ray.connection import (
    RayClusterError,
    alive_nodes,
    check_reachable,
    connect,
    find_node,
    split_address,
)
from tests.ray_cluster import NAMESPACE, NODE_GPUS, LocalRayCluster


def test_the_agent_joins_and_finds_its_own_node_by_name(ray_cluster: LocalRayCluster) -> None:
    connect(ray_cluster.address, namespace=NAMESPACE)
    connect(ray_cluster.address, namespace=NAMESPACE)  # joining again changes nothing
    assert sorted(node.name for node in alive_nodes()) == ["node-a", "node-b"]
    node = find_node("node-b")
    assert node.gpus == NODE_GPUS and node.address == "127.0.0.1"
    assert node.node_id != find_node("node-a").node_id
    with pytest.raises(
        RayClusterError, match=r"no alive Ray node is named 'node-c' \(alive: node-a, node-b\)"
    ):
        find_node("node-c")


def test_an_unreachable_cluster_is_a_clear_error_at_once() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once the socket closes
    started = time.monotonic()
    with pytest.raises(
        RayClusterError, match=rf"cannot reach the Ray cluster at 127.0.0.1:{port} within 2 s"
    ):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2.0)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    "address", ["", "127.0.0.1", "127.0.0.1:", ":6379", "127.0.0.1:port", "127.0.0.1:70000"]
)
def test_a_malformed_address_names_itself(address: str) -> None:
    with pytest.raises(RayClusterError, match="expected host:port of the cluster's GCS"):
        split_address(address)
