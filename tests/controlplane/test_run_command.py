"""The run command on the embedded default: real PostgreSQL and Redis from Python packages."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from celery import Celery

from agents.backends.ray.driver_client import rl_config
from controlplane.stack import STATUS_FILE
from controlplane.supervise import read_status
from jobs.spec import parse_spec
from runtime.rl.warm_start import warm_start_checkpoint, warm_start_weights
from tests.services import REPO_ROOT, free_port, stop_process_tree, wait_until


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def _processes_using(data_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(data_dir) in cmdline:
            found.append(proc)
    return found


def _start(
    data_dir: Path, port: int, log_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if k not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG"}
        },
        **(env or {}),
    }
    log = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "controlplane.stack", "--data-dir", str(data_dir), "--port", str(port), *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _api(port: int, path: str, token: str) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def _assert_demo_is_live(port: int, data_dir: Path) -> None:
    """The demo's simulated hosts register and its two sample jobs run on them."""
    token = (data_dir / "demo-api-token").read_text().strip()

    ready_nodes: set[str] = set()

    def live() -> bool:
        # On a restart the jobs are still running from the last run while the hosts come
        # back one by one (the liveness sweep marks those silent since the stop as lost first), so
        # wait for both together rather than read the hosts the moment the jobs run.
        jobs = _api(port, "/api/v1/jobs/?state=running", token)
        nodes = _api(port, "/api/v1/nodes/?status=ready", token)
        ready_nodes.clear()
        ready_nodes.update(n["name"] for n in nodes["results"])
        return bool(jobs["count"] == 2 and nodes["count"] == 4)

    assert wait_until(live, timeout_s=90, interval_s=1), sorted(ready_nodes)
    assert ready_nodes == {f"sim-node-{i}" for i in range(4)}


def _run_until_healthy_then_interrupt(data_dir: Path, log_path: Path) -> None:
    port = free_port()
    proc = _start(data_dir, port, log_path)
    try:
        healthy = wait_until(
            lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200, timeout_s=120, interval_s=1
        )
        assert healthy, log_path.read_text()[-4000:]
        status, body = _get(f"http://127.0.0.1:{port}/healthz")
        checks = json.loads(body)["checks"]
        assert checks["database"]["detail"].startswith("PostgreSQL")
        assert checks["broker"]["detail"].startswith("redis")
        status, body = _get(f"http://127.0.0.1:{port}/admin/login/")
        assert status == 200 and b"csrfmiddlewaretoken" in body
        # The admin's stylesheet is served too, or the login page is unusable.
        status, _ = _get(f"http://127.0.0.1:{port}/static/admin/css/base.css")
        assert status == 200
        assert _processes_using(data_dir), "expected the embedded servers to run from the data dir"
        _assert_demo_is_live(port, data_dir)
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        stop_process_tree(proc)
    assert wait_until(lambda: not _processes_using(data_dir), timeout_s=10), [
        p.info["cmdline"] for p in _processes_using(data_dir)
    ]
    assert wait_until(lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 0, timeout_s=10)


def test_run_command_serves_health_and_admin_and_leaves_nothing_behind(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    log_path = tmp_path / "run.log"

    _run_until_healthy_then_interrupt(data_dir, log_path)
    first_log = log_path.read_text()
    assert "created admin account" in first_log
    password = (data_dir / "admin-password").read_text().strip()
    cluster_created = (data_dir / "pgdata" / "PG_VERSION").stat().st_mtime_ns

    _run_until_healthy_then_interrupt(data_dir, log_path)
    second_log = log_path.read_text()[len(first_log) :]
    assert "admin account exists" in second_log  # the database was reused, not re-created
    assert (data_dir / "pgdata" / "PG_VERSION").stat().st_mtime_ns == cluster_created
    assert (data_dir / "admin-password").read_text().strip() == password


def _processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if text in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    return found


@pytest.fixture
def demo_warm_start(warm_start_cache: Path) -> Path:
    """The ray demo job's warm start, from the session's cache (computed there if no real job of
    the session has yet)."""
    spec = yaml.safe_load((REPO_ROOT / "controlplane" / "demo" / "real-math-ray.yaml").read_text())
    config = rl_config(parse_spec(spec).to_json())
    warm_start_weights(config, warm_start_cache)
    return warm_start_checkpoint(config, warm_start_cache)


def test_run_command_runs_a_real_job_on_a_local_ray_cluster(tmp_path: Path, demo_warm_start: Path) -> None:
    """The ray demo: a local Ray cluster of two logical nodes, a ray agent per node, and the real
    job training on them; Ctrl-C stops the cluster's processes too."""
    data_dir, log_path, port, ray_port = tmp_path / "data", tmp_path / "run.log", free_port(), free_port()
    # The data directory holds the warm start of an earlier run, as a second `make run` finds it:
    # the job loads it rather than training it again (the warm start's own tests train it).
    shutil.copytree(demo_warm_start, data_dir / "checkpoints" / demo_warm_start.name)
    env = {"DYNARL_DEMO_RAY_PORT": str(ray_port)}
    proc = _start(data_dir, port, log_path, "--demo-backend", "ray", env=env)
    try:
        assert wait_until(
            lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200, timeout_s=120, interval_s=1
        ), log_path.read_text()[-4000:]
        token = (data_dir / "demo-api-token").read_text().strip()

        def trained() -> bool:
            jobs = _api(port, "/api/v1/jobs/?backend=ray", token)["results"]
            return bool(jobs) and bool(_api(port, f"/api/v1/jobs/{jobs[0]['id']}/iterations/", token))

        assert wait_until(trained, timeout_s=300, interval_s=2), log_path.read_text()[-6000:]
        nodes = _api(port, "/api/v1/nodes/?status=ready", token)
        assert {n["name"] for n in nodes["results"]} == {"ray-node-0", "ray-node-1"}
        assert _processes_mentioning(f"127.0.0.1:{ray_port}"), "the Ray cluster's processes"
        proc.send_signal(signal.SIGINT)
        proc.wait(90)
    finally:
        stop_process_tree(proc)
    assert wait_until(lambda: not _processes_mentioning(str(data_dir)), timeout_s=30)
    assert wait_until(lambda: not _processes_mentioning(f"127.0.0.1:{ray_port}"), timeout_s=30), [
        p.info["cmdline"] for p in _processes_mentioning(f"127.0.0.1:{ray_port}")
    ]


# --- A crashed process comes back; the others keep running -------------------------------------

# How each supervised process is recognised among the run command's descendants (python -m ...).
ROLES = {
    "web": ("daphne", None),
    "worker": ("celery", "worker"),
    "beat": ("celery", "beat"),
    "sim-node-0": ("agents.daemon", None),
}


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    log_path: Path

    def healthz(self) -> tuple[int, dict[str, Any]]:
        status, body = _get(f"http://127.0.0.1:{self.port}/healthz")
        return status, (json.loads(body) if status else {})

    def pids(self) -> dict[str, int]:
        """The pid of each role's process, found among the run command's descendants by command line:
        the process itself, not a child of it such as a worker's pool process, and not an orphan
        whose parent has just died."""
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
        cmdlines: dict[int, list[str] | None] = {self.proc.pid: ["run command"]}
        parents: dict[int, int] = {}
        for child in descendants:
            try:
                parents[child.pid] = child.ppid()
                cmdlines[child.pid] = child.cmdline() or None  # a zombie's is empty
            except psutil.Error:  # gone, or a zombie not yet reaped
                cmdlines[child.pid] = None
        found: dict[str, int] = {}
        for pid, parent in parents.items():
            cmdline, parent_cmdline = cmdlines.get(pid), cmdlines.get(parent)
            if cmdline is None or parent_cmdline is None:
                continue
            for role, spec in ROLES.items():
                if _plays(cmdline, spec) and not _plays(parent_cmdline, spec):
                    found[role] = pid
        return found

    def settled(self) -> dict[str, int]:
        """Once every role runs and /healthz is ok: their pids."""
        assert wait_until(lambda: set(self.pids()) == set(ROLES), timeout_s=60), self.pids()
        assert wait_until(lambda: self.healthz()[0] == 200, timeout_s=60), self.healthz()
        return self.pids()

    def processes(self) -> dict[str, Any]:
        """The supervisor's states; none while it keeps no status file."""
        try:
            return read_status(self.data_dir / STATUS_FILE)["processes"]  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {}

    def restarts(self, role: str) -> int:
        return int(self.processes().get(role, {}).get("restarts", 0))

    def log(self) -> str:
        return self.log_path.read_text()

    def worker_pids_answering(self) -> set[int]:
        """The pids the Celery workers report when asked over the embedded broker."""
        probe = Celery(
            "probe", broker=f"redis+socket://{self.data_dir}/redis/redis.sock", set_as_current=False
        )
        try:
            stats = probe.control.inspect(timeout=2).stats() or {}
        except OSError:
            return set()
        finally:
            probe.close()
        return {int(reply["pid"]) for reply in stats.values()}


def _plays(cmdline: list[str], spec: tuple[str, str | None]) -> bool:
    module, sub = spec
    return cmdline[1:3] == ["-m", module] and (sub is None or sub in cmdline)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The run command with one simulated host and no demo jobs, healthy, every role running."""
    tmp_path = tmp_path_factory.mktemp("supervised")
    data_dir, log_path, port = tmp_path / "data", tmp_path / "run.log", free_port()
    proc = _start(data_dir, port, log_path, "--demo-nodes", "1", "--no-demo-jobs")
    running = Stack(proc, port, data_dir, log_path)
    try:
        assert wait_until(lambda: running.healthz()[0] == 200, timeout_s=120, interval_s=1), running.log()[
            -4000:
        ]
        yield running
    finally:
        stop_process_tree(proc, timeout_s=60)
        assert wait_until(lambda: not _processes_using(data_dir), timeout_s=10)


def test_run_command_restarts_a_killed_worker_while_the_rest_keep_running(stack: Stack) -> None:
    before = stack.settled()
    restarts_before = stack.restarts("worker")
    assert wait_until(lambda: stack.worker_pids_answering() == {before["worker"]}, timeout_s=30)

    os.kill(before["worker"], signal.SIGKILL)

    # A new worker process, and it is the one that answers the broker.
    assert wait_until(lambda: stack.pids().get("worker") not in {None, before["worker"]}, timeout_s=60), (
        stack.log()[-4000:]
    )
    new_worker = stack.pids()["worker"]
    assert wait_until(lambda: stack.worker_pids_answering() == {new_worker}, timeout_s=60)
    # The web server, beat and the agent were never stopped.
    others = {role: pid for role, pid in before.items() if role != "worker"}
    assert {role: pid for role, pid in stack.pids().items() if role != "worker"} == others
    assert all(_alive(pid) for pid in others.values())
    # The crash and the restart are logged and reported.
    assert "worker exited (killed by SIGKILL)" in stack.log()
    assert f"worker restarted (pid {new_worker}" in stack.log()
    worker = stack.processes()["worker"]
    assert worker["state"] == "running" and worker["pid"] == new_worker
    assert worker["restarts"] == restarts_before + 1
    assert wait_until(lambda: stack.healthz()[0] == 200, timeout_s=60)
    reported = stack.healthz()[1]["checks"]["processes"]
    assert reported["processes"]["worker"]["restarts"] == restarts_before + 1
    assert "worker running (restarted" in reported["detail"]
    assert "last killed by SIGKILL" in reported["detail"]


def test_run_command_restarts_a_killed_web_server(stack: Stack) -> None:
    before = stack.settled()
    restarts_before = stack.restarts("web")

    os.kill(before["web"], signal.SIGKILL)

    assert wait_until(lambda: stack.pids().get("web") not in {None, before["web"]}, timeout_s=60), (
        stack.log()[-4000:]
    )
    assert wait_until(lambda: stack.healthz()[0] == 200, timeout_s=60), stack.healthz()
    assert stack.restarts("web") == restarts_before + 1
    assert stack.healthz()[1]["checks"]["processes"]["processes"]["web"]["pid"] == stack.pids()["web"]
    assert {role: pid for role, pid in stack.pids().items() if role != "web"} == {
        role: pid for role, pid in before.items() if role != "web"
    }
    assert "web exited (killed by SIGKILL)" in stack.log()


def test_run_command_stops_everything_on_sigterm(stack: Stack) -> None:
    stack.settled()
    descendants = psutil.Process(stack.proc.pid).children(recursive=True)

    stack.proc.send_signal(signal.SIGTERM)

    assert stack.proc.wait(90) == 128 + signal.SIGTERM
    assert wait_until(lambda: not any(_alive(p.pid) for p in descendants), timeout_s=10), [
        p.pid for p in descendants if _alive(p.pid)
    ]
    assert wait_until(lambda: not _processes_using(stack.data_dir), timeout_s=10), [
        p.info["cmdline"] for p in _processes_using(stack.data_dir)
    ]
    assert not (stack.data_dir / STATUS_FILE).exists()
    assert "SIGTERM received: stopping every process" in stack.log()
