"""Writing the audit trail. Every mutation calls ``record`` inside its own transaction."""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.db import models
from django.http import HttpRequest, HttpResponse
from django.utils.decorators import sync_and_async_middleware

from common.models import ActorType, AuditEvent

REQUEST_ID_HEADER = "X-Request-ID"
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("dynarl_request_id", default="")


def current_request_id() -> str:
    return _request_id.get()


@dataclass(frozen=True)
class Actor:
    """Who acts: a user, a node's agent, the scheduler or the system itself."""

    type: ActorType
    label: str
    user: Any = None

    @classmethod
    def for_user(cls, user: Any) -> Actor:
        return cls(ActorType.USER, user.get_username(), user)

    @classmethod
    def for_agent(cls, node_name: str) -> Actor:
        return cls(ActorType.AGENT, f"agent:{node_name}")

    @classmethod
    def scheduler(cls) -> Actor:
        return cls(ActorType.SCHEDULER, "scheduler")

    @classmethod
    def system(cls, label: str = "system") -> Actor:
        return cls(ActorType.SYSTEM, label)


def record(
    actor: Actor,
    verb: str,
    obj: models.Model | tuple[str, str],
    *,
    job: Any = None,
    reason: str = "",
    payload: Mapping[str, Any] | None = None,
) -> AuditEvent:
    if isinstance(obj, tuple):
        object_type, object_id = obj
    else:
        object_type, object_id = obj._meta.label_lower, str(obj.pk)
    return AuditEvent.objects.create(
        actor_type=actor.type,
        actor_user=actor.user if actor.user is not None and actor.user.is_authenticated else None,
        actor=actor.label,
        verb=verb,
        object_type=object_type,
        object_id=object_id,
        job=job,
        reason=reason,
        payload=dict(payload or {}),
        request_id=current_request_id(),
    )


def _request_id_for(request: HttpRequest) -> str:
    incoming = request.headers.get(REQUEST_ID_HEADER, "")
    return incoming if 0 < len(incoming) <= 64 and incoming.isprintable() else uuid.uuid4().hex


@sync_and_async_middleware
def RequestIdMiddleware(get_response: Any) -> Any:
    """Tags each request with an id (the caller's X-Request-ID or a new one), returned as a header
    and written on every audit event the request causes. Async-capable, so long-polling agent
    requests do not each hold a thread."""
    if iscoroutinefunction(get_response):

        async def middleware(request: HttpRequest) -> HttpResponse:
            request_id = _request_id_for(request)
            token = _request_id.set(request_id)
            try:
                response = await get_response(request)
            finally:
                _request_id.reset(token)
            response[REQUEST_ID_HEADER] = request_id
            return response  # type: ignore[no-any-return]

    else:

        def middleware(request: HttpRequest) -> HttpResponse:  # type: ignore[misc]
            request_id = _request_id_for(request)
            token = _request_id.set(request_id)
            try:
                response = get_response(request)
            finally:
                _request_id.reset(token)
            response[REQUEST_ID_HEADER] = request_id
            return response  # type: ignore[no-any-return]

    return middleware
