"""The control plane's one way to reach Redis (``REDIS_URL``): telemetry windows, the heartbeat
reply's job pictures, long-poll wake-ups, health and metrics all connect through here."""

from __future__ import annotations

import functools

import redis
import redis.asyncio as aioredis
from django.conf import settings


@functools.cache
def shared_client() -> redis.Redis:
    """The process's client (one connection pool), without timeouts: for the application's keys."""
    return redis.Redis.from_url(settings.REDIS_URL)


def client_with_timeout(timeout_s: float) -> redis.Redis:
    """A client whose connects and commands give up after ``timeout_s``: for health checks and
    metrics, which must answer even when Redis does not."""
    return redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )


def async_subscriber() -> aioredis.Redis:
    """An asyncio client for a long-lived subscription: no command timeout, a health check every 30 s."""
    return aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=None, health_check_interval=30)
