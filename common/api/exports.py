"""Streaming exports: CSV (one header row, then one row per record) and JSON arrays.

Rows are read from the database in chunks while the response is being sent, so an export of
every migration step ever recorded does not sit in memory. Under ASGI (daphne) the body is an
async iterator that fetches each chunk in the request's sync thread; under WSGI it is a plain
iterator. Either way the browser or the CLI gets ``Content-Disposition: attachment``.

Every export ends. The first chunk is read before the response is returned, so a query the
database refuses answers in the API's error shape instead of a 200 whose body never comes (daphne
keeps a connection open when the application fails after the response has started). A failure
after that is logged with the request id and ends the body early: the export is then cut short
(a JSON array lacks its closing bracket), never left hanging.
"""

# mypy: disallow-subclassing-any=False
# (rest_framework ships no type information; its base classes are Any.)

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse
from rest_framework.renderers import BaseRenderer
from rest_framework.utils.encoders import JSONEncoder

from common.audit import current_request_id

ROWS_PER_CHUNK = 500
CSV_MEDIA_TYPE = "text/csv"
JSON_MEDIA_TYPE = "application/json"

log = logging.getLogger(__name__)


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


def _ending(chunks: Iterator[str], *, first: str | None, filename: str, request_id: str) -> Iterator[str]:
    """``first``, then the rest of ``chunks``; a failure ends the body instead of escaping."""
    if first is None:
        return
    yield first
    sent = 1
    while True:
        try:
            chunk = next(chunks, None)
        except Exception:
            log.exception(
                "export %s failed after %d chunk(s), request id %s; its body ends here",
                filename,
                sent,
                request_id,
            )
            return
        if chunk is None:
            return
        yield chunk
        sent += 1


async def _async_chunks(chunks: Iterator[str]) -> AsyncIterator[str]:
    fetch = sync_to_async(lambda: next(chunks, None), thread_sensitive=True)
    while (chunk := await fetch()) is not None:
        yield chunk


def streaming_response(
    request: HttpRequest, make_lines: Callable[[], Iterable[str]], *, content_type: str, filename: str
) -> StreamingHttpResponse:
    """A response whose body is produced chunk by chunk from ``make_lines``, in the thread Django
    gives to sync code. The first chunk is produced here, so what fails at the start of the
    export (the query itself) raises into the view and answers as an error."""
    chunks = _chunked(make_lines())
    first = next(chunks, None)
    ending = _ending(chunks, first=first, filename=filename, request_id=current_request_id())
    body: Iterator[str] | AsyncIterator[str] = (
        _async_chunks(ending) if isinstance(request, ASGIRequest) else ending
    )
    response = StreamingHttpResponse(body, content_type=f"{content_type}; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response
