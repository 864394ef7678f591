"""WebSocket routes and the stack in front of them: origin check, then who is asking.

Browsers always send ``Origin`` and carry the session cookie, so a page on another site could
ride a logged-in operator's session: their origin must be one of ``ALLOWED_HOSTS``
(``AllowedHostsOriginValidator``). The CLI and scripts send no ``Origin`` and authenticate with
``?token=<API token>``, a credential a foreign page cannot borrow, so a token connection without
an ``Origin`` header is let through; with one, it is checked like any browser.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser
from django.urls import path

from common.api.authentication import touch
from common.models import ApiToken, hash_token
from controlplane.consumers import ClusterEventsConsumer, JobEventsConsumer

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

websocket_urlpatterns = [
    path("ws/jobs/<int:job_id>/", JobEventsConsumer.as_asgi()),
    path("ws/cluster/", ClusterEventsConsumer.as_asgi()),
]


def query_token(scope: Scope) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin1")).get("token")
    return values[0] if values and values[0] else None


def has_origin(scope: Scope) -> bool:
    return any(name == b"origin" for name, _ in scope.get("headers", []))


def user_for_token(raw: str) -> Any:
    """The active user behind an active API token, or an anonymous user."""
    token = ApiToken.objects.select_related("user").filter(key_hash=hash_token(raw)).first()
    if token is None or not token.is_active or not token.user.is_active:
        return AnonymousUser()
    touch(token)
    return token.user


class QueryTokenAuthMiddleware:
    """``?token=`` wins over the session: a script says exactly who it is. A bad token makes the
    connection anonymous (refused by the consumer), never falls back to a cookie."""

    def __init__(self, inner: ASGIApp) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = query_token(scope)
        if raw is not None:
            scope = dict(scope)
            scope["user"] = await database_sync_to_async(user_for_token)(raw)
        await self.inner(scope, receive, send)


class OriginOrTokenValidator:
    """``AllowedHostsOriginValidator`` for browsers; token clients without an Origin pass."""

    def __init__(self, inner: ASGIApp) -> None:
        self.inner = inner
        self.checked: ASGIApp = AllowedHostsOriginValidator(inner)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not has_origin(scope) and query_token(scope) is not None:
            await self.inner(scope, receive, send)
        else:
            await self.checked(scope, receive, send)


def websocket_application() -> ASGIApp:
    return OriginOrTokenValidator(
        AuthMiddlewareStack(QueryTokenAuthMiddleware(URLRouter(websocket_urlpatterns)))
    )
