"""One error shape for every 4xx/5xx the API answers:

    {"error": {"status": 400, "code": "invalid", "message": "...",
               "fields": [{"path": "components[1].parallelism.tp", "message": "..."}],
               "request_id": "..."}}

``handle_exception`` maps DRF and Django exceptions (a body over its limit is a 413) and illegal
state transitions onto that shape, answers a busy database (no pooled connection in time, or the
server at its connection limit) with a 503 and ``Retry-After``, and turns anything unexpected into
a 500 that names the request id but leaks no traceback; the apps' own exceptions (bad specs,
refused submissions, …) are mapped by the project's handler (``controlplane.api.errors``), which
passes them in as ``domain``. ``api_not_found`` answers unknown /api/ URLs with the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist, RequestDataTooBig
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, HttpRequest, JsonResponse
from django.urls import Resolver404, resolve
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import set_rollback

from common.audit import current_request_id
from common.bodies import BodyTooLarge
from common.dbbusy import busy_message, is_database_busy, retry_after_s
from common.transitions import IllegalTransition

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FieldProblem:
    """One problem at one path: a spec key path, a request field, a query parameter or a header."""

    path: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


@dataclass(frozen=True)
class ApiError:
    status: int
    code: str
    message: str
    fields: tuple[FieldProblem, ...] = ()
    headers: Mapping[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.code, self.message, self.fields)


def error_body(
    status_code: int, code: str, message: str, fields: Iterable[FieldProblem] = ()
) -> dict[str, Any]:
    return {
        "error": {
            "status": status_code,
            "code": code,
            "message": message,
            "fields": [f.to_json() for f in fields],
            "request_id": current_request_id(),
        }
    }


# --- flattening DRF validation details into paths ----------------------------------------------


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if key == api_settings.NON_FIELD_ERRORS_KEY:
        return path
    return f"{path}.{key}" if path else key


def flatten_detail(detail: Any, path: str = "") -> list[FieldProblem]:
    """DRF's nested error detail -> one problem per message, at paths like ``steps[2].kind``."""
    if isinstance(detail, Mapping):
        problems: list[FieldProblem] = []
        for key, value in detail.items():
            child_key: str | int = int(key) if isinstance(key, str) and key.isdigit() else key
            problems.extend(flatten_detail(value, _join(path, child_key)))
        return problems
    if isinstance(detail, Sequence) and not isinstance(detail, str):
        if all(isinstance(item, str) for item in detail):
            return [FieldProblem(path, str(item)) for item in detail]
        problems = []
        for index, item in enumerate(detail):
            if item:  # a ListSerializer answers {} for the items that were fine
                problems.extend(flatten_detail(item, _join(path, index)))
        return problems
    return [FieldProblem(path, str(detail))]


def summarise(fields: Sequence[FieldProblem], fallback: str) -> str:
    """A one-line message naming the fields at fault."""
    if not fields:
        return fallback
    described = [f"{f.path}: {f.message}" if f.path else f.message for f in fields[:5]]
    more = f" (and {len(fields) - 5} more)" if len(fields) > 5 else ""
    prefix = "" if len(fields) == 1 else f"{len(fields)} problems: "
    return prefix + "; ".join(described) + more


# --- mapping exceptions ------------------------------------------------------------------------


def _from_api_exception(exc: exceptions.APIException) -> ApiError:
    headers: dict[str, str] = {}
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header
    if getattr(exc, "wait", None):
        headers["Retry-After"] = f"{int(exc.wait)}"
    if isinstance(exc, exceptions.ValidationError):
        fields = tuple(flatten_detail(exc.detail))
        return ApiError(exc.status_code, "invalid", summarise(fields, "invalid input"), fields, headers)
    detail = exc.detail
    if isinstance(detail, exceptions.ErrorDetail):
        code, message = str(detail.code or exc.default_code), str(detail)
    else:
        fields = tuple(flatten_detail(detail))
        code, message = str(exc.default_code), summarise(fields, str(exc.default_detail))
        return ApiError(exc.status_code, code, message, fields, headers)
    return ApiError(exc.status_code, code, message, (), headers)


def api_error_for(exc: BaseException) -> ApiError | None:
    """The error to answer for ``exc``; None for exceptions this API does not expect."""
    if isinstance(exc, Http404 | ObjectDoesNotExist):
        message = str(exc) if isinstance(exc, Http404) and exc.args else "not found"
        return ApiError(status.HTTP_404_NOT_FOUND, "not_found", message)
    if isinstance(exc, DjangoPermissionDenied):
        return _from_api_exception(exceptions.PermissionDenied(*exc.args))
    if isinstance(exc, exceptions.APIException):
        return _from_api_exception(exc)
    if isinstance(exc, BodyTooLarge):
        return ApiError(status.HTTP_413_REQUEST_ENTITY_TOO_LARGE, "payload_too_large", str(exc))
    if isinstance(exc, RequestDataTooBig):
        # What request.body raises past Django's limit for the endpoints that read it.
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return ApiError(
            status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
            "payload_too_large",
            f"the request body is over {limit} bytes, the most this endpoint takes (DATA_UPLOAD_MAX_MEMORY_SIZE)",
        )
    if isinstance(exc, IllegalTransition):
        # str() of both: the states may be TextChoices members, whose repr is not their value.
        current, target = str(exc.current), str(exc.target)
        what = str(exc).split(" cannot go ", 1)[0]
        problem = FieldProblem("state", f"the current state is {current!r}; it cannot become {target!r}")
        message = f"{what} cannot go from {current!r} to {target!r}"
        return ApiError(status.HTTP_409_CONFLICT, "illegal_transition", message, (problem,))
    if is_database_busy(exc):
        log.warning("database busy: %s", exc)
        return ApiError(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            "database_busy",
            busy_message(),
            headers={"Retry-After": str(retry_after_s())},
        )
    return None


def server_error(request_path: str) -> ApiError:
    return ApiError(
        status.HTTP_500_INTERNAL_SERVER_ERROR,
        "server_error",
        f"internal error while handling {request_path}; quote request id {current_request_id()}",
    )


DomainErrors = Callable[[BaseException], "ApiError | None"]


def handle_exception(
    exc: Exception, context: Mapping[str, Any], domain: DomainErrors | None = None
) -> Response:
    """What DRF's EXCEPTION_HANDLER does: every exception becomes one JSON error in the shape above;
    ``domain`` maps the apps' own exceptions first."""
    error = (domain(exc) if domain is not None else None) or api_error_for(exc)
    request = context.get("request")
    if error is None:
        path = getattr(request, "path", "?")
        log.error("unhandled error in %s %s", getattr(request, "method", "?"), path, exc_info=exc)
        error = server_error(path)
    set_rollback()
    if request is not None:
        # Errors are JSON even where the endpoint negotiated another format (CSV exports).
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = JSONRenderer.media_type
    return Response(error.body(), status=error.status, headers=dict(error.headers or {}))


@csrf_exempt  # no session state is touched; a CSRF 403 would hide the real answer
def api_not_found(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
    """Unknown URLs under /api/ answer a JSON 404 (not the HTML page)."""
    message = f"no API endpoint at {request.path}"
    if not request.path_info.endswith("/"):
        try:
            match = resolve(request.path_info + "/")
        except Resolver404:
            match = None
        if match is not None and match.func is not api_not_found:
            message += f"; did you mean {request.path}/ ?"
    body = error_body(status.HTTP_404_NOT_FOUND, "not_found", message)
    return JsonResponse(body, status=status.HTTP_404_NOT_FOUND)
