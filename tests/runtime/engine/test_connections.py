"""The client's connections to an engine under many concurrent callers (a rollout's slots)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil

from tests.runtime.engine.conftest import Served

CALLERS = 40  # above the 20 keep-alive connections an httpx client keeps by default
CALLS = 200


def test_concurrent_callers_each_keep_one_connection_that_the_client_never_closes(
    serve: Callable[..., Served],
) -> None:
    """A connection the client closes on its own can be one it just handed to a waiting call,
    which then reads a closed socket and fails with "Bad file descriptor" (a rollout's turn, and
    with it the job). So under any number of concurrent callers the client opens at most one
    connection per caller and closes none: a connection closed by its client side stays in
    TIME_WAIT on that side, so none may be found there."""
    served = serve(max_running_requests=CALLERS)
    # Every step takes 10 ms, so the callers' requests overlap: each holds its connection for
    # the few steps it decodes.
    served.client.slow_down(0.01)
    port = served.server.port
    # A client of an earlier server that had this port number may have left connections in
    # TIME_WAIT (they last a minute): those are not this client's.
    earlier = {c.laddr for c in connections_to(port) if c.status == psutil.CONN_TIME_WAIT}

    with ThreadPoolExecutor(CALLERS) as callers:
        answers = list(
            callers.map(
                lambda _: served.client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0.0}),
                range(CALLS),
            )
        )

    assert all(len(answer.output_ids) == 2 for answer in answers)
    to_engine = [c for c in connections_to(port) if c.laddr not in earlier]
    closed_by_client = [c for c in to_engine if c.status == psutil.CONN_TIME_WAIT]
    assert not closed_by_client, f"the client closed {len(closed_by_client)} of its connections"
    opened = {c.laddr[1] for c in to_engine if c.laddr}
    assert 0 < len(opened) <= CALLERS


def connections_to(port: int) -> list[Any]:
    """This machine's TCP connections whose remote end is ``port``: a client's side of them."""
    return [c for c in psutil.net_connections("tcp") if c.raddr and c.raddr[1] == port]
