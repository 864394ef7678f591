"""HTTP views of the agent protocol, version 1 (``/api/v1/agent/...``; see docs/agent-protocol.md).

Plain async Django views speaking JSON, not DRF. The command fetch is a long-poll: a hundred
waiting agents must cost sockets, not threads. (While MIDDLEWARE holds sync-only middleware,
RequestIdMiddleware and WhiteNoise today, Django still parks one idle thread per open request to
run it; making those async-capable removes that.) The database work of every view runs on a small
pool of long-lived threads (``AGENT_DB_THREADS``), which take a connection from the process's
pool for each call and hand it back after: at most that many of the pool's connections go to
agents, so heartbeats cannot starve the dashboard and the API. Views only authenticate, decode and
encode; the work is in the ``agents.services`` modules. Errors use the API's one shape:
``{"error": {"status", "code", "message", "fields": [{"path", "message"}], "request_id"}}``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from agents.auth import AgentAuthError, authenticate_node, bootstrap_token
from agents.services import delivery, progress, registration, reports
from agents.services.heartbeat import heartbeat as record_heartbeat
from agents.services.payloads import InvalidPayload
from cluster.models import AgentCommand, Device, Node
from common.audit import current_request_id
from common.bodies import BodyTooLarge, read_limited
from common.dbbusy import busy_message, is_database_busy, retry_after_s
from common.transitions import IllegalTransition
from scheduler.services.gpu_migrations import StepNotForNode, StepNotFound
from scheduler.telemetry import FieldError, TelemetryError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
PROTOCOL_HEADER = "X-Dynarl-Agent-Protocol"
P = ParamSpec("P")
R = TypeVar("R")

_executor_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def _db_executor() -> ThreadPoolExecutor | None:
    """The agent views' database threads; None (AGENT_DB_THREADS=0) runs on Django's own
    thread-sensitive thread, as a sync view would (tests use it to share their transaction)."""
    global _executor
    if settings.AGENT_DB_THREADS <= 0:
        return None
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=settings.AGENT_DB_THREADS, thread_name_prefix="agent-db"
            )
        return _executor


def _on_fresh_connection(func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    # What Django does at a request's start and end: drop a connection that broke or grew too
    # old; with the connection pool (CONN_MAX_AGE=0) the end hands it back for other threads.
    close_old_connections()
    try:
        return func(*args, **kwargs)
    finally:
        close_old_connections()


async def run_db(func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run blocking database work off the event loop (the request's context, e.g. its request id,
    goes along)."""
    executor = _db_executor()
    if executor is None:
        return await sync_to_async(func)(*args, **kwargs)
    return await sync_to_async(_on_fresh_connection, thread_sensitive=False, executor=executor)(
        func, *args, **kwargs
    )


def error_response(status: int, code: str, message: str, fields: Iterable[FieldError] = ()) -> JsonResponse:
    response = JsonResponse(
        {
            "error": {
                "status": status,
                "code": code,
                "message": message,
                "fields": [f.to_json() for f in fields],
                "request_id": current_request_id(),
            }
        },
        status=status,
    )
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="dynarl-agent"'
    return response


def _error_for(exc: Exception) -> JsonResponse | None:
    """The protocol's answer to a known failure; None for anything unexpected (a 500)."""
    if isinstance(exc, AgentAuthError):
        return error_response(401, "not_authenticated", str(exc))
    if isinstance(exc, InvalidPayload | TelemetryError):
        return error_response(400, "invalid", "the request body is invalid", exc.errors)
    if isinstance(exc, reports.NotYourCommand | StepNotForNode):
        return error_response(403, "permission_denied", str(exc))
    if isinstance(exc, reports.CommandNotFound | StepNotFound):
        return error_response(404, "not_found", f"no such command or step: {exc}")
    if isinstance(exc, BodyTooLarge):
        return error_response(413, "payload_too_large", str(exc))
    if isinstance(exc, IllegalTransition):
        return error_response(409, "conflict", str(exc))
    if isinstance(exc, redis.RedisError):
        return error_response(503, "unavailable", "the telemetry store is unavailable; retry with backoff")
    if is_database_busy(exc):
        response = error_response(503, "database_busy", busy_message())
        response["Retry-After"] = str(retry_after_s())
        return response
    return None


def _json_body(request: HttpRequest) -> Any:
    # Agents' bodies have their own limit (a step report can carry a rollout's whole queue), not
    # the browser forms' DATA_UPLOAD_MAX_MEMORY_SIZE that ``request.body`` enforces.
    raw = read_limited(
        request,
        request.META,
        limit=settings.AGENT_MAX_BODY_BYTES,
        what="agent requests",
        setting="AGENT_MAX_BODY_BYTES",
    )
    try:
        return json.loads(raw or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidPayload([FieldError("", f"not valid JSON: {exc}")]) from exc


def _finish(response: HttpResponse) -> HttpResponse:
    response[PROTOCOL_HEADER] = str(PROTOCOL_VERSION)
    return response


def _method_not_allowed(request: HttpRequest, methods: tuple[str, ...]) -> HttpResponse:
    response = error_response(405, "method_not_allowed", f"use {' or '.join(methods)}, not {request.method}")
    response["Allow"] = ", ".join(methods)
    return response


AsyncView = Callable[..., Coroutine[Any, Any, HttpResponse]]


def agent_view(*methods: str) -> Callable[[AsyncView], AsyncView]:
    def decorate(view: AsyncView) -> AsyncView:
        @functools.wraps(view)
        async def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in methods:
                return _finish(_method_not_allowed(request, methods))
            try:
                response = await view(request, *args, **kwargs)
            except Exception as exc:
                handled = _error_for(exc)
                if handled is None:
                    # Agents parse one error shape, whatever went wrong; the traceback goes to the log.
                    log.exception("agent request %s %s failed", request.method, request.path)
                    handled = error_response(
                        500, "server_error", "unexpected server error; retry with backoff"
                    )
                response = handled
            return _finish(response)

        return csrf_exempt(wrapped)

    return decorate


# --- JSON shapes ---------------------------------------------------------------------------------


def node_json(node: Node) -> dict[str, Any]:
    return {
        "name": node.name,
        "status": node.status,
        "status_reason": node.status_reason,
        "backend": node.backend,
        "backends": list(node.backends),
        "agent_version": node.agent_version,
        "labels": node.labels,
        "registered_at": node.registered_at.isoformat(),
    }


def device_json(device: Device) -> dict[str, Any]:
    return {
        "index": device.index,
        "uid": device.uid,
        "hardware": device.hardware,
        "memory_gb": device.memory_gb,
        "status": device.status,
        "worker": device.worker.name if device.worker is not None else None,
    }


def report_json(outcome: reports.ReportOutcome) -> dict[str, Any]:
    command: AgentCommand = outcome.command
    return {
        "command_id": command.command_id,
        "kind": command.kind,
        "state": command.state,
        "repeated": outcome.repeated,
        "finished_at": command.finished_at.isoformat() if command.finished_at else None,
        "result": command.result,
    }


def protocol_settings() -> dict[str, Any]:
    from django.conf import settings

    return {
        "heartbeat_interval_s": settings.AGENT_HEARTBEAT_INTERVAL_S,
        "lost_after_s": settings.NODE_LOST_AFTER_S,
        "long_poll_wait_s": delivery.DEFAULT_WAIT_S,
        "long_poll_max_wait_s": delivery.MAX_WAIT_S,
        "redeliver_after_s": settings.AGENT_COMMAND_REDELIVER_S,
    }


# --- views ---------------------------------------------------------------------------------------


def _register(request: HttpRequest, body: Any) -> dict[str, Any]:
    outcome = registration.register(bootstrap_token(request), body)
    devices = Device.objects.filter(pk__in=[d.pk for d in outcome.devices]).select_related("worker")
    return {
        "protocol": PROTOCOL_VERSION,
        "created": outcome.created,
        "token": outcome.token,
        "node": node_json(outcome.node),
        "devices": [device_json(d) for d in devices.order_by("index")],
        "workers": outcome.workers,
        "jobs": outcome.jobs,
        "settings": protocol_settings(),
    }


@agent_view("POST")
async def register(request: HttpRequest) -> HttpResponse:
    reply = await run_db(_register, request, _json_body(request))
    return JsonResponse(reply, status=201 if reply["created"] else 200)


def _heartbeat(request: HttpRequest, body: Any) -> dict[str, Any]:
    node = authenticate_node(request)
    outcome = record_heartbeat(node, body)
    return {
        **outcome.ingest.to_json(),
        "node_status": outcome.node_status,
        "recovered": outcome.recovered,
        "server_time": outcome.server_time,
        "jobs": progress.reply_for(node),
    }


@agent_view("POST")
async def heartbeat(request: HttpRequest) -> HttpResponse:
    return JsonResponse(await run_db(_heartbeat, request, _json_body(request)))


def _wait_seconds(request: HttpRequest) -> float:
    raw = request.GET.get("wait")
    if raw is None:
        return delivery.DEFAULT_WAIT_S
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not math.isfinite(wait) or not 0 <= wait <= delivery.MAX_WAIT_S:
        raise InvalidPayload(
            [FieldError("wait", f"must be a number of seconds from 0 to {delivery.MAX_WAIT_S:g}")]
        )
    return wait


@agent_view("GET")
async def commands(request: HttpRequest) -> HttpResponse:
    node = await run_db(authenticate_node, request)
    wait = _wait_seconds(request)
    delivered = await delivery.wait_for_commands(node, wait, run=run_db)
    return JsonResponse({"commands": [delivery.command_json(c) for c in delivered]})


def _report_command(request: HttpRequest, command_id: str, body: Any) -> dict[str, Any]:
    return report_json(reports.report_command(authenticate_node(request), command_id, body))


@agent_view("POST")
async def report_command(request: HttpRequest, command_id: str) -> HttpResponse:
    return JsonResponse(await run_db(_report_command, request, command_id, _json_body(request)))


def _report_step(request: HttpRequest, step_id: str, body: Any) -> dict[str, Any]:
    node = authenticate_node(request)
    attempt = body.get("attempt") if isinstance(body, Mapping) else None
    if attempt is not None and (isinstance(attempt, bool) or not isinstance(attempt, int)):
        raise InvalidPayload([FieldError("attempt", "must be an integer")])
    return report_json(reports.report_step(node, step_id, attempt, body))


@agent_view("POST")
async def report_step(request: HttpRequest, step_id: str) -> HttpResponse:
    return JsonResponse(await run_db(_report_step, request, step_id, _json_body(request)))
