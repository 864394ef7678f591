"""A live dynarl stack for tests: daphne (HTTP + WebSocket), a real Celery worker and beat on the
test database, and node agents (``python -m agents.daemon`` with the ``sim`` backend, or the
``ray`` backend on a local Ray cluster) as processes.

Test packages expose the fixture through their conftest::

    from tests.stack import live_stack  # noqa: F401

and use it in tests marked ``@pytest.mark.django_db(transaction=True)`` (the processes only see
committed rows)::

    @pytest.mark.django_db(transaction=True)
    def test_x(live_stack: LiveStack) -> None:
        live_stack.start_agent("node-a", gpus=8, hardware="H100").wait_registered()
        status, job = live_stack.api("POST", "/api/v1/jobs/", spec)  # as the stack's operator

Settings for the control plane are ``FAST_SETTINGS``; a test module changes them by overriding the
``stack_settings`` fixture. Every process logs under the test's ``tmp_path``; ``logs()`` gathers
them for an assertion's message. ``stop()`` (the fixture's teardown) leaves no process behind.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from agents.backends.ray import LOOPBACK_ENV
from agents.models import BootstrapToken
from cluster.models import Node, NodeStatus
from common.models import ApiToken, hash_token
from controlplane.processes import daphne_command
from tests.factories import make_user
from tests.services import REPO_ROOT, celery_process, free_port, stop_process_tree, wait_until

# Control-plane settings that make a live test fast: ticks every second, short signal window,
# snapshots and predictor checks within seconds, quick re-delivery of unanswered commands.
FAST_SETTINGS: dict[str, str] = {
    "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    "PYTHONUNBUFFERED": "1",
    "LOG_LEVEL": "WARNING",
    "AGENT_HEARTBEAT_INTERVAL_S": "0.5",
    "AGENT_POLL_FALLBACK_S": "1",
    "AGENT_COMMAND_REDELIVER_S": "5",
    "TICK_SCHEDULE_S": "1",
    "SIGNAL_WINDOW_S": "4",
    "SNAPSHOT_EVERY_S": "5",
    "PREDICTOR_SETTLE_S": "3",
    "STEP_TIMEOUT_MIN_S": "60",  # tests restart agents themselves; no step should time out
    "NODE_LOST_AFTER_S": "30",
    "NODE_LIVENESS_CHECK_S": "2",
    "TELEMETRY_BUCKET_S": "2",
}
DEFAULT_SIM_SPEED = 20.0  # virtual seconds per wall second: a 1.5B job's iteration in a few seconds


class LiveServer:
    """daphne serving the ASGI app on a fixed port; it can be stopped and started again (a
    control-plane restart) on the same port."""

    def __init__(self, env: Mapping[str, str], logs: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(env)
        self.logs = logs
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def answers(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.url}/api/v1/agent/commands", timeout=1)
        except urllib.error.HTTPError:
            return True  # 401: it answers
        except OSError:
            return False
        return True

    def start(self) -> None:
        self.starts += 1
        log = open(self.logs / f"daphne-{self.starts}.log", "wb")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            daphne_command("-b", "127.0.0.1", "-p", str(self.port)),
            cwd=REPO_ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        assert wait_until(self.answers, timeout_s=60), self.log_text()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_tree(self.proc)
            self.proc = None
        assert wait_until(lambda: not self.answers(), timeout_s=10), "daphne still answers"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.logs.glob("daphne-*.log")))


class NodeAgent:
    """``python -m agents.daemon`` with its backend (``sim`` or ``ray``), as a process. Every
    start is a new process on the same state directory (node token, command journal), as a
    restarted host."""

    def __init__(
        self,
        stack: LiveStack,
        host: str,
        *,
        backend: str,
        options: Mapping[str, Any],
        env: Mapping[str, str],
    ) -> None:
        self.stack = stack
        self.host = host
        self.workdir = stack.workdir / "agents" / host
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state_dir = self.workdir / "state"
        self.faults_file = self.workdir / "faults"  # read before every step (``arm``)
        self.backend = backend
        self.options = dict(options)
        self.env = dict(env)
        self.starts = 0
        self.started_at = timezone.now()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, **env: str) -> None:
        """Start the agent (again). ``env`` adds to or overrides its environment for this start;
        faults (``DYNARL_SIM_FAULTS``) given at ``start_agent`` apply to the first start only, so a
        restarted agent does not crash again unless told to."""
        assert not self.running(), f"agent {self.host} is running"
        self.starts += 1
        self.started_at = timezone.now()
        environ = {
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(REPO_ROOT),
            "PYTHONUNBUFFERED": "1",
            "DYNARL_URL": self.stack.url,
            "DYNARL_BOOTSTRAP_TOKEN": self.stack.bootstrap_token,
            "DYNARL_HOST": self.host,
            "DYNARL_STATE_DIR": str(self.state_dir),
            "DYNARL_BACKEND": self.backend,
            "DYNARL_BACKEND_OPTIONS": json.dumps(self.options),
            "DYNARL_NVML": "0",
            "DYNARL_RETRY_MAX_S": "1",
            "DYNARL_POLL_WAIT_S": "5",
            "DYNARL_SHUTDOWN_GRACE_S": "10",
            "DYNARL_LOG_LEVEL": "INFO",
            "DYNARL_AGENT_FAULTS_FILE": str(self.faults_file),
            **self.env,
            **env,
        }
        for drill in ("DYNARL_SIM_FAULTS", "DYNARL_AGENT_FAULTS"):  # for the first start only
            if self.starts > 1 and drill not in env:
                environ.pop(drill, None)
        log = open(self.workdir / f"agent-{self.starts}.log", "wb")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agents.daemon"],
            cwd=REPO_ROOT,
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def arm(self, faults: str) -> None:
        """Arm the agent, running or not, with the fault drill ``faults`` (``crash:switch@1``;
        ``""`` disarms it): its fault file, which it reads before every step, replaced whole."""
        partial = self.faults_file.with_suffix(".partial")
        partial.write_text(faults + "\n")
        os.replace(partial, self.faults_file)

    def kill(self) -> None:
        """SIGKILL: the agent dies where it stands, as in a crash."""
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM: the agent finishes or rolls back the step in hand and exits."""
        if self.proc is not None and self.proc.poll() is None:
            stop_process_tree(self.proc, timeout_s=30)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def node(self) -> Node | None:
        return Node.objects.filter(name=self.host).first()

    def wait_registered(self, timeout_s: float = 60) -> Node:
        """Until the node has registered since this start and is ready."""

        def ready() -> bool:
            node = self.node()
            return (
                node is not None and node.status == NodeStatus.READY and node.registered_at >= self.started_at
            )

        assert wait_until(ready, timeout_s=timeout_s), f"{self.host} did not register:\n{self.log_text()}"
        node = self.node()
        assert node is not None
        return node

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("agent-*.log")))


class LiveStack:
    """daphne + Celery worker + Celery beat on the test database, and sim agents on demand."""

    def __init__(self, env: Mapping[str, str], workdir: Path, settings_env: Mapping[str, str]) -> None:
        self.workdir = workdir
        self.env = {**env, **FAST_SETTINGS, **settings_env}
        self.server = LiveServer(self.env, workdir)
        self.url = self.server.url
        self.agents: dict[str, NodeAgent] = {}
        self._worker: ExitStack | None = None
        self._beat: ExitStack | None = None
        self.bootstrap_token = "boot-" + secrets.token_urlsafe(16)
        BootstrapToken.objects.create(name="live-stack", key_hash=hash_token(self.bootstrap_token))
        self.operator = make_user("stack-operator", "operator")
        self.operator_token = ApiToken.issue(self.operator, "live-stack")[1]

    # -- the control plane ---------------------------------------------------------------------

    def start_control_plane(self) -> None:
        self.server.start()
        self.start_celery()

    def stop_control_plane(self) -> None:
        """daphne, then the worker and beat stop; the agents keep running (and retrying)."""
        self.server.stop()
        self.stop_celery()

    def restart_server(self) -> None:
        """Stop daphne and start it again on the same port."""
        self.server.stop()
        self.server.start()

    def start_celery(self) -> None:
        from controlplane.celery import app

        assert self._worker is None and self._beat is None, "Celery is running"
        self._worker = ExitStack()
        self._worker.enter_context(celery_process("worker", self.env, self.workdir))
        assert wait_until(lambda: bool(app.control.ping(timeout=0.5)), timeout_s=60), self.celery_log(
            "worker"
        )
        self._beat = ExitStack()
        self._beat.enter_context(celery_process("beat", self.env, self.workdir))

    def stop_celery(self) -> None:
        for running in (self._beat, self._worker):
            if running is not None:
                running.close()
        self._beat = self._worker = None

    def celery_log(self, kind: str) -> str:
        path = self.workdir / f"{kind}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- agents ----------------------------------------------------------------------------------

    def start_agent(
        self,
        host: str,
        *,
        gpus: int = 8,
        hardware: str = "H100",
        speed: float = DEFAULT_SIM_SPEED,
        faults: str = "",
        seed: int = 0,
        **env: str,
    ) -> NodeAgent:
        """A new sim host (agents of one cluster share the trace ``seed``); ``faults`` as in
        ``DYNARL_SIM_FAULTS`` (docs/sim-backend.md), for this first start only."""
        assert host not in self.agents, f"agent {host} exists; use agent({host!r}).start()"
        extra = dict(env)
        if faults:
            extra["DYNARL_SIM_FAULTS"] = faults
        options = {"gpus": gpus, "hardware": hardware, "speed": speed, "seed": seed}
        agent = NodeAgent(self, host, backend="sim", options=options, env=extra)
        self.agents[host] = agent
        agent.start()
        return agent

    def start_ray_agent(self, host: str, *, address: str, namespace: str, checkpoint_dir: Path) -> NodeAgent:
        """An agent of the Ray node named ``host`` in the cluster at ``address`` (registering the
        GPUs the Ray node offers), its drivers' checkpoints under ``checkpoint_dir``."""
        assert host not in self.agents, f"agent {host} exists; use agent({host!r}).start()"
        options = {"address": address, "namespace": namespace, "checkpoint_dir": str(checkpoint_dir)}
        agent = NodeAgent(self, host, backend="ray", options=options, env=dict(LOOPBACK_ENV))
        self.agents[host] = agent
        agent.start()
        return agent

    def agent(self, host: str) -> NodeAgent:
        return self.agents[host]

    # -- the REST API ----------------------------------------------------------------------------

    def api(
        self, method: str, path: str, body: Any = None, *, headers: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        """A request with the operator's token; returns (status, decoded JSON body or None)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.operator_token}",
                "Accept": "application/json",
                "Content-Type": "application/json",
                **(headers or {}),
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                raw = response.read()
                status = response.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        return status, (json.loads(raw) if raw else None)

    # -- teardown --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Everything stops; no process is left behind."""
        for agent in self.agents.values():
            agent.stop()
        self.stop_celery()
        if self.server.running():
            self.server.stop()

    def logs(self) -> str:
        """Every process's log, for a failing assertion's message."""
        parts = [f"--- daphne\n{self.server.log_text()}"]
        parts += [f"--- {kind}\n{self.celery_log(kind)}" for kind in ("worker", "beat")]
        parts += [f"--- agent {a.host}\n{a.log_text()}" for a in self.agents.values()]
        return "\n".join(parts)


def flush_test_redis() -> None:
    """The test Redis database belongs to this test run: drop what an earlier test or run left
    (progress and telemetry keyed by ids a new test database reuses, queued tasks)."""
    redis.Redis.from_url(settings.REDIS_URL).flushdb()


@pytest.fixture
def stack_settings() -> dict[str, str]:
    """Extra control-plane environment for the stack; a module overrides this fixture to change a
    setting (e.g. ``{"PREDICTOR_SETTLE_S": "10"}``)."""
    return {}


@pytest.fixture
def live_stack(
    transactional_db: None, service_env: dict[str, str], tmp_path: Path, stack_settings: dict[str, str]
) -> Iterator[LiveStack]:
    """daphne + a Celery worker + Celery beat (ticking every second) on the test database, with a
    bootstrap token for agents and an operator API token; stopped with every agent at the end."""
    flush_test_redis()
    stack = LiveStack(service_env, tmp_path, stack_settings)
    try:
        stack.start_control_plane()
        yield stack
    finally:
        stack.stop()
        flush_test_redis()
