"""Streaming exports: CSV (one header row, then one row per record) and JSON arrays.

Rows are read from the database in chunks while the response is being sent, so an export of
every migration step ever recorded does not sit in memory. Under ASGI (daphne) the body is an
async iterator that fetches each chunk in the request's sync thread; under WSGI it is a plain
iterator. Either way the browser or the CLI gets ``Content-Disposition: attachment``.
"""

# mypy: disallow-subclassing-any=False
# (rest_framework ships no type information; its base classes are Any.)

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse
from rest_framework.renderers import BaseRenderer
from rest_framework.utils.encoders import JSONEncoder

ROWS_PER_CHUNK = 500
CSV_MEDIA_TYPE = "text/csv"
JSON_MEDIA_TYPE = "application/json"


class CSVRenderer(BaseRenderer):
    """Selects CSV in content negotiation (``?format=csv`` or ``Accept: text/csv``). Export views
    stream their own body; this renders a list of flat records when a Response carries one."""

    media_type = CSV_MEDIA_TYPE
    format = "csv"
    charset = "utf-8"

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Mapping[str, Any] | None = None,
    ) -> bytes:
        records = data if isinstance(data, list) else [data]
        if not records:
            return b""
        header = list(records[0].keys())
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(header)
        for record in records:
            writer.writerow([csv_value(record.get(column)) for column in header])
        return buffer.getvalue().encode(self.charset)


def csv_value(value: Any) -> Any:
    """Spreadsheet-friendly cells: ISO times, space-separated lists, JSON for nested objects."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, cls=JSONEncoder)
    return value


def _chunked(items: Iterable[str]) -> Iterator[str]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) >= ROWS_PER_CHUNK:
            yield "".join(batch)
            batch = []
    if batch:
        yield "".join(batch)


def csv_lines(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)

    def line(values: Sequence[Any]) -> str:
        buffer.seek(0)
        buffer.truncate()
        writer.writerow([csv_value(v) for v in values])
        return buffer.getvalue()

    yield line(header)
    for row in rows:
        yield line(row)


def json_array(items: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    yield "["
    for index, item in enumerate(items):
        yield ("," if index else "") + json.dumps(item, cls=JSONEncoder)
    yield "]"


async def _async_chunks(make_chunks: Callable[[], Iterator[str]]) -> AsyncIterator[str]:
    chunks: Iterator[str] | None = None

    def next_chunk() -> str | None:
        nonlocal chunks
        if chunks is None:
            chunks = make_chunks()
        return next(chunks, None)

    fetch = sync_to_async(next_chunk, thread_sensitive=True)
    while (chunk := await fetch()) is not None:
        yield chunk


def streaming_response(
    request: HttpRequest, make_lines: Callable[[], Iterable[str]], *, content_type: str, filename: str
) -> StreamingHttpResponse:
    """A response whose body is produced chunk by chunk from ``make_lines`` (called lazily, so
    the database is read while sending, in the thread Django gives to sync code)."""

    def chunks() -> Iterator[str]:
        return _chunked(make_lines())

    body: Iterator[str] | AsyncIterator[str] = (
        _async_chunks(chunks) if isinstance(request, ASGIRequest) else chunks()
    )
    response = StreamingHttpResponse(body, content_type=f"{content_type}; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response
