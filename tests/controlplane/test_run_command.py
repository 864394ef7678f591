"""The run command on the embedded default: real PostgreSQL and Redis from Python packages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

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


def _start(data_dir: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    env = {
        k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG"}
    }
    log = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "controlplane.stack", "--data-dir", str(data_dir), "--port", str(port)],
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

    def running() -> bool:
        jobs = _api(port, "/api/v1/jobs/?state=running", token)
        return bool(jobs["count"] == 2)

    assert wait_until(running, timeout_s=90, interval_s=1)
    nodes = _api(port, "/api/v1/nodes/?status=ready", token)
    assert nodes["count"] == 4
    assert {n["name"] for n in nodes["results"]} == {f"sim-node-{i}" for i in range(4)}


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
