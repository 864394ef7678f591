"""/v1/loads and /server_info (and the fallback to older routes), and the prefix cache's LRU."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from runtime.engine.client import EngineClient
from runtime.engine.prefix_cache import PrefixCache
from tests.runtime.engine.conftest import WAIT_S, Served

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_loads_report_queues_utilisation_occupancy_and_throughput(serve: Callable[..., Served]) -> None:
    served = serve(max_running_requests=2)
    served.client.slow_down(0.01)
    params = {"max_new_tokens": 200, "temperature": 0.0}
    with ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(served.client.generate, PROMPT, params, f"load-{index}.") for index in range(3)
        ]
        served.wait(lambda: served.engine.state()["decode_steps"] >= 3, "three decode steps of two requests")
        load = served.client.loads()
        served.client.abort_request(abort_all=True)
        assert all(future.result(WAIT_S).aborted for future in futures)
    assert (load.num_running_reqs, load.num_waiting_reqs, load.max_running_requests) == (2, 1, 2)
    assert load.utilization == 1.0 and not load.from_old_route
    assert load.gen_throughput is not None and load.gen_throughput > 0
    assert isinstance(load.raw, dict)
    extra = load.raw["loads"][0]["cpu_engine"]
    # Two of two slots busy in most steps (the first steps may have run before all arrived).
    assert 0.5 < extra["decode_step_occupancy"] <= 1.0
    assert extra["generated_tokens"] >= 6
    info = served.client.server_info()
    assert info["max_running_requests"] == 2 and info["weight_version"] == "default"


class _OldServer(BaseHTTPRequestHandler):
    """An SGLang of the older routes: /get_server_info and /get_load only."""

    def do_GET(self) -> None:
        answers = {
            "/get_server_info": {"weight_version": "old-7", "max_running_requests": 16},
            "/get_load": [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 300}],
        }
        body = json.dumps(answers.get(self.path, {"detail": "Not Found"})).encode()
        self.send_response(200 if self.path in answers else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def old_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OldServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(WAIT_S)


def test_the_client_falls_back_to_the_older_routes_on_404(old_server: str) -> None:
    with EngineClient(old_server) as client:
        assert client.weight_version() == "old-7"
        load = client.loads()
    assert load.from_old_route
    assert (load.num_running_reqs, load.num_waiting_reqs, load.max_running_requests) == (3, 2, None)


def test_the_prefix_cache_hits_a_shared_prefix_and_evicts_least_recently_used(
    serve: Callable[..., Served],
) -> None:
    # Block 4, budget 16 tokens = 4 blocks; each 9-token prompt leaves two full blocks.
    served = serve(prefix_block_size=4, prefix_cache_tokens=16)
    params = {"max_new_tokens": 1, "temperature": 0.0}
    a, b, c = PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1], [2, 2, 2, 2, 3, 3, 3, 3, 4]

    def cached(prompt: list[int]) -> int:
        return served.client.generate(prompt, params).cached_tokens

    assert cached(a) == 0
    assert cached([*a[:8], 30]) == 8  # shares a's two blocks
    assert cached(b) == 0  # cache now full: a's two blocks, b's two blocks
    assert cached(a) == 8  # a is now more recent than b
    assert cached(c) == 0  # over budget: b, the least recently used, goes
    assert cached(a) == 8
    assert cached(b) == 0
    state = served.engine.state()
    assert state["prefix_cache_tokens"] <= 16 and state["prefix_cache_evicted_blocks"] >= 4
    assert state["prefix_hit_tokens"] == 24
    assert state["reprefilled_tokens"] == 7 * 9 - 24


def test_eviction_takes_leaves_before_the_prefix_they_share() -> None:
    cache = PrefixCache(block_size=2, token_budget=6)

    def kv(start: int, end: int) -> torch.Tensor:
        return torch.full((1, 2, 1, end - start, 1), float(start))

    cache.insert([1, 1, 2, 2], kv)  # root -> [1,1] -> [2,2]
    cache.insert([1, 1, 3, 3], kv)  # shares [1,1]; 3 blocks now
    cache.insert([1, 1, 4, 4], kv)  # 4 blocks > 3: the oldest leaf [2,2] goes, not [1,1]
    assert cache.match([1, 1, 2, 2], max_tokens=4).tokens == 2
    assert cache.match([1, 1, 3, 3], max_tokens=4).tokens == 4
    assert cache.match([1, 1, 4, 4], max_tokens=4).tokens == 4
    assert cache.match([1, 1, 4, 4], max_tokens=3).tokens == 2  # never past max_tokens
    assert cache.num_blocks == 3 and cache.evicted_blocks == 1
