"""Agents speaking the protocol through Django's test client, against real PostgreSQL and Redis."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest
from django.test import Client

from agents.models import BootstrapToken
from common import redis as common_redis
from common.models import hash_token


@pytest.fixture(autouse=True)
def clean_agent_keys(redis_reachable: None) -> Iterator[None]:
    """Node ids restart with each test database: drop the keys an earlier run left behind."""

    def drop() -> None:
        client = common_redis.shared_client()
        for pattern in ("dynarl:telemetry:*", "dynarl:agent:*"):
            keys = list(client.scan_iter(match=pattern, count=1000))
            if keys:
                client.delete(*keys)

    drop()
    yield
    drop()


@pytest.fixture(autouse=True)
def agent_db_on_test_thread(settings: Any) -> None:
    """The agent views' database work runs where the test's transaction is (a real server, as in
    test_long_poll, uses the thread pool)."""
    settings.AGENT_DB_THREADS = 0


@pytest.fixture
def bootstrap() -> str:
    raw = "boot-" + secrets.token_urlsafe(16)
    BootstrapToken.objects.create(name="test-bootstrap", key_hash=hash_token(raw))
    return raw


def devices(count: int, hardware: str = "H100", memory_gb: float = 80.0) -> list[dict[str, Any]]:
    return [{"index": i, "hardware": hardware, "memory_gb": memory_gb} for i in range(count)]


@dataclass
class Agent:
    """One node's agent: its token and the requests it makes."""

    client: Client
    host: str
    token: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def post(self, url: str, body: Any) -> Any:
        return self.client.post(url, data=body, content_type="application/json", headers=self.headers())

    def heartbeat(self, body: dict[str, Any]) -> Any:
        return self.post("/api/v1/agent/heartbeat", body)

    def fetch(self, wait: float | str = 0) -> Any:
        return self.client.get(f"/api/v1/agent/commands?wait={wait}", headers=self.headers())

    def report(self, command_id: str, body: dict[str, Any]) -> Any:
        return self.post(f"/api/v1/agent/commands/{quote(command_id, safe='')}/report", body)


def register(
    client: Client, bootstrap: str, host: str, *, gpus: int = 4, hardware: str = "H100", **extra: Any
) -> tuple[Agent, dict[str, Any]]:
    response = client.post(
        "/api/v1/agent/register",
        data={
            "host": host,
            "agent_version": "0.1.0",
            "backend": "sim",
            "devices": devices(gpus, hardware),
            **extra,
        },
        content_type="application/json",
        headers={"Authorization": f"Bearer {bootstrap}"},
    )
    assert response.status_code in (200, 201), response.content
    body = response.json()
    return Agent(client, host, body["token"]), body
