"""Request bodies read with a size limit, answered 413 when over it.

Endpoints whose bodies have their own limit (agent reports: ``AGENT_MAX_BODY_BYTES``; job specs:
``JOB_SPEC_MAX_BYTES``) read them here instead of through ``request.body``, whose limit is the
browser forms' ``DATA_UPLOAD_MAX_MEMORY_SIZE``. The declared length is checked before anything is
read, and no more than one byte past the limit is ever read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class BodyTooLarge(Exception):
    """A request body over its limit; the message names the limit and the setting that sets it."""

    def __init__(self, message: str, *, limit: int, setting: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.setting = setting


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


def declared_length(meta: Mapping[str, Any]) -> int:
    """The request's Content-Length; 0 when absent or unreadable (reading then finds the truth)."""
    try:
        return int(meta.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0


def read_limited(stream: _Readable, meta: Mapping[str, Any], *, limit: int, what: str, setting: str) -> bytes:
    """The body of a request (``stream`` with its ``META``), at most ``limit`` bytes; over it,
    ``BodyTooLarge`` saying "<what> may be at most <limit> bytes (<setting>)"."""
    length = declared_length(meta)
    if length > limit:
        raise BodyTooLarge(
            f"the request body is {length} bytes; {what} may be at most {limit} bytes ({setting})",
            limit=limit,
            setting=setting,
        )
    raw = stream.read(limit + 1)
    if len(raw) > limit:
        raise BodyTooLarge(
            f"the request body is over {limit} bytes; {what} may be at most {limit} bytes ({setting})",
            limit=limit,
            setting=setting,
        )
    return raw
