"""The agent's HTTP client for the agent protocol, over the standard library only.

JSON in and out; an error answer is parsed from the API's one shape
``{"error": {"status", "code", "message", "fields", "request_id"}}`` into :class:`ApiError`.
:func:`retrying` retries connection errors and 5xx/429 answers with exponential backoff and jitter,
never other 4xx: those will not change by asking again.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

PROTOCOL_VERSION = 1
PROTOCOL_HEADER = "X-Dynarl-Agent-Protocol"
T = TypeVar("T")
log = logging.getLogger(__name__)


class ApiError(Exception):
    """The control plane answered with an error status."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        fields: list[dict[str, Any]] | None = None,
        request_id: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.fields = fields or []
        self.request_id = request_id
        self.retry_after_s = retry_after_s
        detail = "; ".join(f"{f.get('path')}: {f.get('message')}" for f in self.fields)
        super().__init__(f"HTTP {status} {code}: {message}" + (f" ({detail})" if detail else ""))

    @property
    def retryable(self) -> bool:
        """5xx (the server or its database/Redis failed) and 429; never another 4xx."""
        return self.status >= 500 or self.status == 429


class Unreachable(Exception):
    """No answer from the control plane.

    ``maybe_delivered`` is True when the request was sent and the connection broke while waiting
    for the answer: the server may have acted on it. False when it never got there (refused, no
    route, name not resolved), so sending something else instead is safe.
    """

    def __init__(self, reason: str, *, maybe_delivered: bool) -> None:
        self.maybe_delivered = maybe_delivered
        super().__init__(reason)


class GaveUp(Exception):
    """Retrying stopped (shutdown, or a deadline passed) before the control plane answered."""


def quote_id(value: str) -> str:
    """Command and step ids hold ':', '@', '#' and '/': one path segment, percent-encoded."""
    return quote(value, safe="")


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: rare from this server, and the backoff covers it
    return max(0.0, seconds)


def _error_from(exc: urllib.error.HTTPError) -> ApiError:
    raw = b""
    with contextlib.suppress(OSError):
        raw = exc.read()
    retry_after = _retry_after(exc.headers.get("Retry-After") if exc.headers else None)
    try:
        body = json.loads(raw or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError):
        body = None
    error = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(error, Mapping):
        fields = error.get("fields")
        return ApiError(
            exc.code,
            str(error.get("code", f"http_{exc.code}")),
            str(error.get("message", exc.reason)),
            fields=[f for f in fields if isinstance(f, dict)] if isinstance(fields, list) else [],
            request_id=str(error.get("request_id") or ""),
            retry_after_s=retry_after,
        )
    # Not the API's shape: a proxy or load balancer answered.
    text = raw.decode("utf-8", "replace").strip()[:200]
    return ApiError(exc.code, f"http_{exc.code}", text or str(exc.reason), retry_after_s=retry_after)


@dataclass
class ControlPlaneClient:
    base_url: str
    user_agent: str = "dynarl-agent"
    timeout_s: float = 10.0

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        token: str = "",
        timeout_s: float | None = None,
    ) -> Any:
        """One request; returns the decoded JSON answer. Raises ApiError or Unreachable."""
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        headers = {
            "Accept": "application/json",
            "User-Agent": self.user_agent,
            PROTOCOL_HEADER: str(PROTOCOL_VERSION),
        }
        if data is not None:
            headers["Content-Type"] = "application/json"
        if token:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise _error_from(exc) from exc
        except urllib.error.URLError as exc:
            # urllib wraps failures while connecting and sending: the request never arrived whole.
            raise Unreachable(f"{method} {path}: {exc.reason}", maybe_delivered=False) from exc
        except (OSError, http.client.HTTPException) as exc:
            # Sent, then the connection broke or timed out while waiting for the answer.
            raise Unreachable(f"{method} {path}: {type(exc).__name__}: {exc}", maybe_delivered=True) from exc
        try:
            return json.loads(raw or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise Unreachable(f"{method} {path}: the answer is not JSON", maybe_delivered=True) from exc


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: attempt n waits a random time up to
    ``min(max_s, base_s * 2**n)``, so agents cut off together do not come back in step."""

    base_s: float = 0.5
    max_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, attempt: int) -> float:
        ceiling = min(self.max_s, self.base_s * 2.0 ** min(attempt, 32))
        return self.rng.uniform(0, ceiling)


def retrying(
    call: Callable[[], T],
    *,
    backoff: Backoff,
    describe: str,
    give_up: threading.Event | None = None,
    deadline: float | None = None,
) -> T:
    """``call()`` until it answers; connection errors and 5xx/429 are retried after a backoff.

    Other ApiErrors propagate at once. Raises GaveUp when ``give_up`` is set or the monotonic
    ``deadline`` passes first.
    """
    attempt = 0
    while True:
        if give_up is not None and give_up.is_set():
            raise GaveUp(describe)
        try:
            return call()
        except ApiError as exc:
            if not exc.retryable:
                raise
            reason, floor = str(exc), exc.retry_after_s or 0.0
        except Unreachable as exc:
            reason, floor = str(exc), 0.0
        delay = min(max(floor, backoff.delay(attempt)), max(backoff.max_s, backoff.base_s))
        attempt += 1
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GaveUp(f"{describe}: {reason}")
            delay = min(delay, remaining)
        # An outage retries every few seconds for as long as it lasts: say so, not every time.
        level = logging.WARNING if attempt <= 3 or attempt % 20 == 0 else logging.DEBUG
        log.log(level, "%s failed (%s); retry %d in %.1fs", describe, reason, attempt, delay)
        if give_up is not None:
            if give_up.wait(delay):
                raise GaveUp(describe)
        else:
            time.sleep(delay)
