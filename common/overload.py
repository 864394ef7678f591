"""503 with Retry-After for the views that found the database busy (``common.dbbusy``).

DRF views answer through the API's exception handler, which does the same; the middleware covers
every other view (dashboard pages, the admin, /metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string

from common.api.errors import error_body
from common.dbbusy import busy_message, is_database_busy, retry_after_s

log = logging.getLogger(__name__)


def _wants_json(request: HttpRequest) -> bool:
    accept = request.headers.get("Accept", "")
    return request.path.startswith("/api/") or ("json" in accept and "html" not in accept)


def busy_response(request: HttpRequest) -> HttpResponse:
    """503 with Retry-After: JSON in the API's error shape for API clients, a page for browsers.
    Rendered without the request: context processors would want the database again."""
    response: HttpResponse
    if _wants_json(request):
        response = JsonResponse(error_body(503, "database_busy", busy_message()), status=503)
    else:
        html = render_to_string(
            "common/busy.html", {"message": busy_message(), "retry_after_s": retry_after_s()}
        )
        response = HttpResponse(html, status=503)
    response["Retry-After"] = str(retry_after_s())
    return response


class DatabaseBusyMiddleware:
    """Turns a view's busy-database error into ``busy_response``."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not is_database_busy(exception):
            return None
        log.warning("database busy in %s %s: %s", request.method, request.path, exception)
        return busy_response(request)
