"""A worker runs as a Ray actor on its agent's node with exactly the devices the control plane
gave it, serves (here: the CPU engine speaking SGLang's protocol), is found again by name, and
stops without leaving its actor behind."""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import replace

import psutil
import ray

from agents.backends.ray.actors import (
    ActorProcess,
    actor_process,
    node_workers,
    start_engine_worker,
    stop_worker,
    worker_handle,
)
from agents.backends.ray.connection import connect, find_node
from runtime.engine.client import EngineClient
from runtime.engine.cpu_engine import EngineSettings
from runtime.model.config import GPTConfig
from tests.ray_cluster import NAMESPACE, LocalRayCluster

CONFIG = GPTConfig(
    vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, ffn_hidden_size=32, max_positions=64
)


def test_an_engine_worker_runs_pinned_to_its_node_with_its_devices_and_stops(
    ray_cluster: LocalRayCluster,
) -> None:
    connect(ray_cluster.address, namespace=NAMESPACE)
    node = find_node("node-b")
    devices = [{"index": 1, "shared": False}, {"index": 3, "shared": False}]
    url = start_engine_worker(node, "j1-rollout-w0", devices, CONFIG, EngineSettings(max_running_requests=2))
    try:
        handle = worker_handle("node-b", "j1-rollout-w0")
        assert handle is not None
        assert ray.get(handle.node_id.remote(), timeout=30) == node.node_id
        assert ray.get(handle.visible_devices.remote(), timeout=30) == "1,3"
        assert node_workers("node-b") == ["j1-rollout-w0"] and node_workers("node-a") == []
        client = EngineClient(url)
        result = client.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0}, return_logprob=True)
        assert result.completion_tokens == 4 and len(result.output_logprobs) == 4
        process = actor_process(handle, timeout_s=30)
        assert process is not None and process.running_here()
    finally:
        assert stop_worker("node-b", "j1-rollout-w0")
    assert not process.running_here()  # stopped means its process has ended, not only been told to
    assert node_workers("node-b") == [] and worker_handle("node-b", "j1-rollout-w0") is None
    assert not stop_worker("node-b", "j1-rollout-w0")  # stopping it again is not an error
    assert not EngineClient(url, timeout_s=2.0).health()  # its server ended with it


def test_an_actor_process_is_running_only_while_that_very_process_lives_on_this_host() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(child.pid).create_time()
        alive = ActorProcess(host=socket.gethostname(), pid=child.pid, started=started)
        assert alive.running_here()
        assert not replace(alive, started=started - 1).running_here()  # the pid, reused by another
        assert not replace(alive, host=f"not-{socket.gethostname()}").running_here()
    finally:
        child.kill()
    child.wait(timeout=30)
    assert not alive.running_here()
