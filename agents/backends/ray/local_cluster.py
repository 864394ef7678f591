"""A Ray cluster of several logical nodes on this machine, on loopback only.

For the test suite, ``make run``'s ray demo and the real-job benchmark: a head and more nodes,
each with its own raylet, node name and logical GPUs (``num_gpus`` is a resource label; no device
is needed), one CPU each. ``ray start --address`` cannot build this on Linux: a worker node started
by the CLI either resolves 127.0.0.1 to the machine's network address (without the loopback switch,
``LOOPBACK_ENV``) or refuses to start (with it). Ray's own local multi-node cluster
(``ray.cluster_utils.Cluster``) starts the nodes from one process instead, with the switch set for
every Ray process.

    python -m agents.backends.ray.local_cluster --nodes ray-node-0,ray-node-1 --gpus 4 --port 6380

runs until SIGTERM or SIGINT, then stops every node's processes. The environment must already hold
``LOOPBACK_ENV`` (Ray reads it when imported).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from agents.backends.ray import LOOPBACK_ENV

HEALTH_CHECK_FAILURES = 40  # Ray's default is 5 checks, 3 s apart


def loopback_ready() -> bool:
    return all(os.environ.get(name) == value for name, value in LOOPBACK_ENV.items())


def start_local_cluster(nodes: Sequence[str], *, gpus: int, port: int | None = None) -> Any:
    """Start the nodes (the first is the head, its GCS on ``port`` when given) and return Ray's
    ``Cluster`` once all are alive; ``shutdown()`` stops them."""
    if not loopback_ready():
        variables = " ".join(f"{name}={value}" for name, value in LOOPBACK_ENV.items())
        raise RuntimeError(
            f"a loopback Ray cluster needs {variables} in the environment before Ray is imported"
        )
    if not nodes:
        raise ValueError("a cluster needs at least one node")
    # Imported here, after the environment check: Ray reads the switch when it is imported.
    from ray.cluster_utils import Cluster

    common: dict[str, Any] = {"num_cpus": 1, "num_gpus": gpus, "node_ip_address": "127.0.0.1"}
    head: dict[str, Any] = {
        **common,
        "node_name": nodes[0],
        "include_dashboard": False,
        # All nodes share this machine's cores: while a job's workers start (each imports torch),
        # a raylet may answer the GCS's health checks late; it is not dead for that.
        "_system_config": {"health_check_failure_threshold": HEALTH_CHECK_FAILURES},
    }
    if port is not None:
        head["gcs_server_port"] = port
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for name in nodes[1:]:
            cluster.add_node(**common, node_name=name)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()  # type: ignore[no-untyped-call]
        raise
    return cluster


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agents.backends.ray.local_cluster", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nodes", required=True, help="node names, comma-separated; the first is the head")
    parser.add_argument("--gpus", type=int, default=4, help="logical GPUs per node")
    parser.add_argument("--port", type=int, default=None, help="the head's GCS port (default: a free one)")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.nodes.split(",") if name.strip()]
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        cluster = start_local_cluster(names, gpus=args.gpus, port=args.port)
    except (RuntimeError, ValueError) as exc:
        print(f"local Ray cluster: {exc}", file=sys.stderr)
        return 2
    print(f"local Ray cluster at {cluster.address}: {', '.join(names)}", flush=True)
    try:
        stop.wait()
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
