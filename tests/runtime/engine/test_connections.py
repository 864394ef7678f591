"""The client's connections to an engine under many concurrent callers (a rollout's slots)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psutil

from tests.runtime.engine.conftest import Served

CALLERS = 40  # above the 20 keep-alive connections an httpx client keeps by default
CALLS = 400


def test_concurrent_callers_each_keep_one_connection_that_the_client_never_closes(
    serve: Callable[..., Served],
) -> None:
    """A connection the client closes on its own can be one it just handed to a waiting call,
    which then reads a closed socket and fails with "Bad file descriptor" (a rollout's turn, and
    with it the job). So under any number of concurrent callers the client opens at most one
    connection per caller and closes none: a connection closed by its client side stays in
    TIME_WAIT on that side, so none may be found there."""
    served = serve()
    port = served.server.port

    with ThreadPoolExecutor(CALLERS) as callers:
        answers = list(callers.map(lambda _: served.client.health(), range(CALLS)))

    assert all(answers)
    # The client's side of each connection: the engine's port is its remote end.
    to_engine = [c for c in psutil.net_connections("tcp") if c.raddr and c.raddr[1] == port]
    closed_by_client = [c for c in to_engine if c.status == psutil.CONN_TIME_WAIT]
    assert not closed_by_client, f"the client closed {len(closed_by_client)} of its connections"
    opened = {c.laddr[1] for c in to_engine if c.laddr}
    assert 0 < len(opened) <= CALLERS
