"""A real control plane (daphne serving the ASGI app, on the test database) and the agent daemon as
a real process, driven by RecordingBackend."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.models import BootstrapToken
from common import redis as common_redis
from common.models import hash_token
from tests.agent_daemon.recording import read_calls
from tests.services import REPO_ROOT, stop_process_tree
from tests.stack import LiveServer

RECORDING_BACKEND = "tests.agent_daemon.recording:RecordingBackend"


@pytest.fixture(autouse=True)
def clean_agent_keys(redis_reachable: None) -> Iterator[None]:
    """Node ids restart with each test database: drop the heartbeat keys an earlier run left."""

    def drop() -> None:
        client = common_redis.shared_client()
        for pattern in ("dynarl:telemetry:*", "dynarl:agent:*"):
            keys = list(client.scan_iter(match=pattern, count=1000))
            if keys:
                client.delete(*keys)

    drop()
    yield
    drop()


@pytest.fixture
def server(service_env: dict[str, str], tmp_path: Path) -> Iterator[LiveServer]:
    live = LiveServer(
        {
            **service_env,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "AGENT_HEARTBEAT_INTERVAL_S": "0.2",
            "AGENT_POLL_FALLBACK_S": "1",
        },
        tmp_path,
    )
    live.start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def bootstrap() -> str:
    raw = "boot-" + secrets.token_urlsafe(16)
    BootstrapToken.objects.create(name="daemon-tests", key_hash=hash_token(raw))
    return raw


class AgentProcess:
    """``python -m agents.daemon`` with RecordingBackend; each start is a new agent process
    sharing the state directory and the record of calls."""

    def __init__(self, server: LiveServer, bootstrap: str, workdir: Path, host: str = "gpu-node-1") -> None:
        self.server = server
        self.bootstrap = bootstrap
        self.host = host
        self.workdir = workdir
        self.state_dir = workdir / "agent-state"
        self.record = workdir / "calls.jsonl"
        self.hold_launch = workdir / "release-launch"
        self.hold_steps = workdir / "release-steps"
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, hold_launch: bool = False, hold_steps: bool = False, **env: str) -> None:
        assert self.proc is None or self.proc.poll() is not None, "the agent is running"
        self.starts += 1
        options = [f"record={self.record}", "gpus=4"]
        if hold_launch:
            options.append(f"hold_launch={self.hold_launch}")
        if hold_steps:
            options.append(f"hold_steps={self.hold_steps}")
        environ = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(REPO_ROOT),
            "DYNARL_URL": self.server.url,
            "DYNARL_BOOTSTRAP_TOKEN": self.bootstrap,
            "DYNARL_HOST": self.host,
            "DYNARL_STATE_DIR": str(self.state_dir),
            "DYNARL_BACKEND": RECORDING_BACKEND,
            "DYNARL_BACKEND_OPTIONS": ",".join(options),
            "DYNARL_RETRY_MAX_S": "1",
            "DYNARL_POLL_WAIT_S": "5",
            "DYNARL_SHUTDOWN_GRACE_S": "10",
            "DYNARL_LOG_LEVEL": "INFO",
            **env,
        }
        log = open(self.workdir / f"agent-{self.starts}.log", "wb")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agents.daemon"],
            cwd=REPO_ROOT,
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL: the agent dies where it stands, as in a crash."""
        self.signal(signal.SIGKILL)
        self.wait(10)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def calls(self, call: str | None = None) -> list[dict[str, Any]]:
        return read_calls(self.record, call)

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("agent-*.log")))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process_tree(self.proc, timeout_s=30)


@pytest.fixture
def agent(server: LiveServer, bootstrap: str, tmp_path: Path) -> Iterator[AgentProcess]:
    process = AgentProcess(server, bootstrap, tmp_path)
    try:
        yield process
    finally:
        process.stop()
