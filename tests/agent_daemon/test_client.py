"""The agent's HTTP client against a real HTTP server (the standard library's, on a free port):
the API's error shape, what is retried and what never is, and which failures may have reached
the server."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agents.daemon.client import ApiError, Backoff, ControlPlaneClient, GaveUp, Unreachable, retrying
from tests.services import free_port

FAST = Backoff(base_s=0.01, max_s=0.05)


class Script:
    """What the server answers, request by request, and what it saw."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, Any]] = []
        self.seen: list[dict[str, Any]] = []


@pytest.fixture
def served() -> Iterator[tuple[ControlPlaneClient, Script]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            script.seen.append(
                {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
            )
            status, payload = script.answers.pop(0) if script.answers else (200, {"ok": True})
            if status == 0:  # hang up after reading the request: the answer is lost
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ControlPlaneClient(f"http://127.0.0.1:{server.server_port}"), script
    finally:
        server.shutdown()
        server.server_close()


def error(status: int, code: str, message: str, fields: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "error": {
            "status": status,
            "code": code,
            "message": message,
            "fields": fields or [],
            "request_id": "r1",
        }
    }


def test_json_in_and_out_with_the_token_and_protocol_headers(
    served: tuple[ControlPlaneClient, Script],
) -> None:
    client, script = served
    script.answers = [(200, {"commands": []})]
    assert client.request("POST", "/api/v1/agent/heartbeat", body={"sent_at": 1.5}, token="tok") == {
        "commands": []
    }
    [seen] = script.seen
    assert json.loads(seen["body"]) == {"sent_at": 1.5}
    assert seen["headers"]["Authorization"] == "Bearer tok"
    assert seen["headers"]["X-Dynarl-Agent-Protocol"] == "1"


def test_server_errors_are_retried_until_answered(served: tuple[ControlPlaneClient, Script]) -> None:
    client, script = served
    script.answers = [
        (503, error(503, "unavailable", "redis down")),
        (500, b"<html>oops</html>"),
        (200, {"n": 1}),
    ]
    assert retrying(lambda: client.request("GET", "/x"), backoff=FAST, describe="test") == {"n": 1}
    assert len(script.seen) == 3


def test_client_errors_are_never_retried(served: tuple[ControlPlaneClient, Script]) -> None:
    client, script = served
    script.answers = [
        (
            400,
            error(
                400,
                "invalid",
                "the request body is invalid",
                [{"path": "ok", "message": "must be true or false"}],
            ),
        )
    ]
    with pytest.raises(ApiError) as caught:
        retrying(lambda: client.request("POST", "/x", body={}), backoff=FAST, describe="test")
    assert len(script.seen) == 1
    exc = caught.value
    assert (exc.status, exc.code, exc.request_id, exc.retryable) == (400, "invalid", "r1", False)
    assert exc.fields == [{"path": "ok", "message": "must be true or false"}]
    assert "ok: must be true or false" in str(exc)


def test_a_refused_connection_never_reached_the_server() -> None:
    client = ControlPlaneClient(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Unreachable) as caught:
        client.request("GET", "/x")
    assert caught.value.maybe_delivered is False


def test_a_lost_answer_may_have_been_delivered(served: tuple[ControlPlaneClient, Script]) -> None:
    client, script = served
    script.answers = [(0, None)]
    with pytest.raises(Unreachable) as caught:
        client.request("POST", "/x", body={"a": 1})
    assert caught.value.maybe_delivered is True
    assert len(script.seen) == 1


def test_retrying_stops_when_told_to() -> None:
    client = ControlPlaneClient(f"http://127.0.0.1:{free_port()}")
    stop = threading.Event()
    stop.set()
    with pytest.raises(GaveUp):
        retrying(lambda: client.request("GET", "/x"), backoff=FAST, describe="test", give_up=stop)


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    backoff = Backoff(base_s=0.5, max_s=4.0)
    delays = [[backoff.delay(n) for _ in range(200)] for n in range(6)]
    assert all(0 <= d <= 0.5 for d in delays[0])
    assert all(0 <= d <= 4.0 for d in delays[5]) and max(delays[5]) > 2.0
    assert len({round(d, 6) for d in delays[5]}) > 100  # jittered, not in step
