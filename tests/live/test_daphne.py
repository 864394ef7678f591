"""The production server (daphne) serves HTTP and the WebSockets from one ASGI app.

A real daphne process on a free port, spoken to over plain sockets: an HTTP request, then a
WebSocket handshake and frames, with events published from this test process through Redis.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common import events
from common.models import ApiToken
from tests.live.conftest import make_job, make_user
from tests.services import REPO_ROOT, free_port, stop_process_tree, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def daphne(service_env: dict[str, str], tmp_path: Path) -> Iterator[int]:
    port = free_port()
    log = (tmp_path / "daphne.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"],
        env={**service_env, "DJANGO_SETTINGS_MODULE": "controlplane.settings"},
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    try:
        assert wait_until(listening, timeout_s=30), (tmp_path / "daphne.log").read_text()
        yield port
    finally:
        stop_process_tree(proc)
        log.close()


class WebSocket:
    """Just enough of RFC 6455 for a client: the handshake, masked text frames out, frames in."""

    def __init__(self, port: int, path: str, headers: dict[str, str] | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: 127.0.0.1:{port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = self.sock.recv(4096)
            if not chunk:
                break
            response += chunk
        head, _, self.pending = response.partition(b"\r\n\r\n")
        self.status = int(head.split(b" ")[1]) if head else 0

    def _read(self, n: int) -> bytes:
        while len(self.pending) < n:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("closed")
            self.pending += chunk
        data, self.pending = self.pending[:n], self.pending[n:]
        return data

    def receive(self) -> tuple[int, bytes]:
        first, second = self._read(2)
        length = second & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", self._read(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", self._read(8))
        return first & 0x0F, self._read(length)

    def receive_json(self) -> Any:
        opcode, payload = self.receive()
        assert opcode == 1, (opcode, payload)  # a text frame
        return json.loads(payload)

    def send_json(self, value: Any) -> None:
        payload = json.dumps(value).encode()
        mask = os.urandom(4)
        assert len(payload) < 126
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)

    def close(self) -> None:
        self.sock.close()


def test_daphne_serves_http_and_live_events(daphne: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{daphne}/metrics", timeout=15) as answer:
        assert answer.status == 200
        assert b"dynarl_queue_length" in answer.read()

    viewer = make_user("viewer")
    job = make_job(viewer, "live")
    _, raw = ApiToken.issue(viewer, "script")

    socket_ = WebSocket(daphne, f"/ws/jobs/{job.pk}/?token={raw}")
    assert socket_.status == 101
    hello = socket_.receive_json()
    assert (hello["type"], hello["data"]["job"]["id"]) == ("hello", job.pk)
    events.publish("migration", {"migration_id": "m-9", "state": "committed"}, job_id=job.pk)
    event = socket_.receive_json()
    assert (event["type"], event["data"]["migration_id"]) == ("migration", "m-9")
    socket_.send_json({"type": "ping"})
    assert socket_.receive_json()["type"] == "pong"
    socket_.close()

    # A browser page from another site, riding a session, is refused at the handshake.
    foreign = WebSocket(daphne, "/ws/cluster/", {"Origin": "https://evil.example"})
    assert foreign.status == 403
    foreign.close()

    # Without credentials the socket opens and closes at once with 4401, so a client knows why.
    anonymous = WebSocket(daphne, "/ws/cluster/", {"Origin": f"http://127.0.0.1:{daphne}"})
    assert anonymous.status == 101
    opcode, payload = anonymous.receive()
    assert opcode == 8  # close
    assert struct.unpack("!H", payload[:2])[0] == 4401
    anonymous.close()


@pytest.mark.timeout(120)
def test_an_export_daphne_serves_always_ends(daphne: int) -> None:
    """``before`` with an offset PostgreSQL refuses (+21:15) made the export's query fail after
    the response had started; daphne then kept the connection open with nothing sent."""
    viewer = make_user("viewer")
    _, raw = ApiToken.issue(viewer, "export")
    request = urllib.request.Request(
        f"http://127.0.0.1:{daphne}/api/v1/migrations/export/?before=2875-05-13T17:19:49%2B21:15",
        headers={"Authorization": f"Bearer {raw}"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:  # a hang is a timeout here
        assert answer.status == 200
        assert answer.read().decode().startswith("id,migration_id,")
