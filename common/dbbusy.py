"""A database with no connection to give: how to tell, and what tasks do about it.

Each process holds at most ``DB_POOL_MAX_SIZE`` connections; a request or task that waits longer
than ``DB_POOL_TIMEOUT_S`` for one gets ``psycopg_pool.PoolTimeout``, and a server at its limit
refuses new connections ("too many clients already", SQLSTATE 53300). Both mean "busy, come back
soon", never a bug: HTTP answers 503 with ``Retry-After: DB_BUSY_RETRY_AFTER_S`` (see
``common.overload``, the API's exception handler and the agent protocol's views), and Celery
tasks run again later (``retry_when_busy``, ``skip_when_busy``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.errors
from django.conf import settings
from django.db import DatabaseError
from psycopg_pool import PoolTimeout, TooManyRequests

log = logging.getLogger(__name__)

# What PostgreSQL says when it refuses a connection for want of slots. A refused connection is
# reported before any SQLSTATE can be read, so the text is what there is to go by.
_BUSY_TEXTS = (
    "too many clients already",
    "too many connections for",  # ... role "x" / ... database "x" (CONNECTION LIMIT)
    "remaining connection slots are reserved",
)


def is_database_busy(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says no connection could be had now."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PoolTimeout | TooManyRequests | psycopg.errors.TooManyConnections):
            return True
        if isinstance(current, psycopg.OperationalError | DatabaseError):
            text = str(current)
            if any(busy in text for busy in _BUSY_TEXTS):
                return True
        current = current.__cause__ or current.__context__
    return False


def retry_after_s() -> int:
    return int(settings.DB_BUSY_RETRY_AFTER_S)


def busy_message() -> str:
    return (
        "the control plane has no free database connection right now (too many requests at once); "
        f"retry in {retry_after_s()} s"
    )


@contextmanager
def retry_when_busy(task: Any) -> Iterator[None]:
    """In a bound Celery task: when the database is busy, run the task again in
    ``DB_BUSY_RETRY_AFTER_S`` seconds instead of failing it, up to the task's ``max_retries``
    times; then let it go with a warning (for work that beat sends again anyway)."""
    try:
        yield
    except DatabaseError as exc:
        if not is_database_busy(exc):
            raise
        retries = task.request.retries
        if task.max_retries is not None and retries >= task.max_retries:
            log.warning("%s: database still busy after %s retries; left to the next beat", task.name, retries)
            return
        delay = retry_after_s()
        log.warning("%s: database busy, retrying in %s s (%s)", task.name, delay, exc)
        # The retry gets its own expiry: the first delivery's may be over by then.
        raise task.retry(countdown=delay, expires=delay + 30, exc=exc) from exc


@contextmanager
def skip_when_busy(what: str) -> Iterator[None]:
    """In a periodic task: when the database is busy, skip this round with a warning (beat sends
    the next one soon)."""
    try:
        yield
    except DatabaseError as exc:
        if not is_database_busy(exc):
            raise
        log.warning("%s: database busy, skipped until the next beat (%s)", what, exc)
