"""Joining a Ray cluster as a node's agent, and finding that node in it.

An agent runs on a GPU host beside that host's raylet and joins the cluster as a driver. It must
fail fast and clearly when the cluster cannot be reached (``ray.init`` itself retries for minutes),
and it must know which Ray node is its own, so that its workers are pinned there
(``NodeAffinitySchedulingStrategy``): the node is found by the name it was started with
(``ray start --node-name``), which the agent is configured with (its host name by default).

Several Ray nodes on one machine (tests, a laptop) only stay on the loopback address when Ray is
told the machine is not part of a multi-host cluster: Ray otherwise replaces 127.0.0.1 with the
machine's network address when it resolves the GCS (``LOOPBACK_ENV``, for every Ray process,
read by Ray when it is imported). A loopback address without it is refused at once.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray._private import ray_constants

from agents.backends.base import BackendUnavailable
from agents.backends.ray import LOOPBACK_ENV


class RayClusterError(BackendUnavailable):
    """The Ray cluster cannot be used by this agent; the message says why and what was tried."""


@dataclass(frozen=True)
class RayNode:
    """One alive node of the cluster, as the agent pins workers to it."""

    node_id: str
    name: str
    address: str
    gpus: float  # logical GPUs the node offers (num_gpus)
    cpus: float
    memory_gb: float = 0.0  # the memory Ray may give its workers there

    @classmethod
    def from_ray(cls, info: Mapping[str, Any]) -> RayNode:
        resources = info.get("Resources", {})
        return cls(
            node_id=str(info["NodeID"]),
            name=str(info.get("NodeName", "")),
            address=str(info.get("NodeManagerAddress", "")),
            gpus=float(resources.get("GPU", 0.0)),
            cpus=float(resources.get("CPU", 0.0)),
            memory_gb=float(resources.get("memory", 0.0)) / float(1 << 30),
        )


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` of a GCS; RayClusterError naming the address when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayClusterError(f"Ray address {address!r}: expected host:port of the cluster's GCS")
    return host, int(port)


def check_reachable(address: str, *, timeout_s: float) -> None:
    """A TCP connection to the GCS within ``timeout_s``, else RayClusterError: a clear error at
    once instead of ``ray.init`` retrying for minutes."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise RayClusterError(
            f"cannot reach the Ray cluster at {address} within {timeout_s:g} s ({exc}); "
            "is `ray start --head` running there?"
        ) from exc


def connect(address: str, *, namespace: str, timeout_s: float = 10.0) -> None:
    """Join the cluster at ``address`` as a driver in ``namespace`` (named actors live there).
    Joining again in the same process is a no-op."""
    if ray.is_initialized():
        return
    check_reachable(address, timeout_s=timeout_s)
    host, _ = split_address(address)
    loopback = host in ("127.0.0.1", "localhost")
    if loopback and ray_constants.ENABLE_RAY_CLUSTER:
        # Ray would dial this machine's network address instead, and retry for minutes.
        variables = " ".join(f"{name}={value}" for name, value in LOOPBACK_ENV.items())
        raise RayClusterError(
            f"the Ray cluster at {address} is on loopback: set {variables} in the environment of every "
            "Ray process and of this agent (before Ray is imported)"
        )
    try:
        ray.init(
            address=address,
            namespace=namespace,
            # A driver reports its own address too; on a loopback cluster it must be loopback.
            _node_ip_address=host if loopback else None,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayClusterError(f"joining the Ray cluster at {address} failed: {exc}") from exc


def alive_nodes() -> list[RayNode]:
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [RayNode.from_ray(info) for info in nodes if info.get("Alive")]


def find_node(name: str) -> RayNode:
    """The alive node started as ``name`` (``ray start --node-name``); RayClusterError listing the
    names there are when none is, or when two are (workers could land on either)."""
    nodes = alive_nodes()
    matches = [node for node in nodes if node.name == name]
    if len(matches) == 1:
        return matches[0]
    names = sorted(node.name for node in nodes)
    if not matches:
        raise RayClusterError(
            f"no alive Ray node is named {name!r} (alive: {', '.join(names) or 'none'}); start this "
            f"host's raylet with `ray start --node-name {name}` or give the agent its Ray node's name"
        )
    raise RayClusterError(f"{len(matches)} alive Ray nodes are named {name!r}; node names must be unique")
