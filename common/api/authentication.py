"""API authentication: ``Authorization: Bearer <token>`` with an ApiToken, besides the browser session.

Tokens are looked up by the SHA-256 of the raw key (only the hash is stored). A revoked or expired
token, or one whose user was deactivated, is refused with 401. ``last_used_at`` is written at most
once per TOKEN_TOUCH_INTERVAL so a busy CLI does not turn every read into a write.
"""

# mypy: disallow-subclassing-any=False
# (rest_framework and drf_spectacular ship no type information; their base classes are Any.)

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import Q
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from common.models import ApiToken, hash_token

TOKEN_TOUCH_INTERVAL = timedelta(minutes=1)
BEARER = "Bearer"


class ApiTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer dynarl_...``; acts as the token's user, with that user's role."""

    def authenticate(self, request: Request) -> tuple[Any, ApiToken] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != BEARER.lower().encode():
            return None  # not ours: let the session (or nothing) authenticate
        if len(parts) != 2:
            raise AuthenticationFailed("malformed Authorization header: expected 'Bearer <token>'")
        try:
            raw = parts[1].decode("ascii")
        except UnicodeDecodeError as exc:
            raise AuthenticationFailed("invalid token") from exc
        token = ApiToken.objects.select_related("user").filter(key_hash=hash_token(raw)).first()
        if token is None:
            raise AuthenticationFailed("invalid token")
        if token.revoked_at is not None:
            raise AuthenticationFailed("token revoked")
        if token.expires_at is not None and token.expires_at <= timezone.now():
            raise AuthenticationFailed("token expired")
        if not token.user.is_active:
            raise AuthenticationFailed("user inactive")
        touch(token)
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        # Makes DRF answer 401 (not 403) to requests without credentials.
        return f'{BEARER} realm="api"'


def touch(token: ApiToken) -> None:
    """Record use, at most once per TOKEN_TOUCH_INTERVAL (a conditional UPDATE, so concurrent
    requests do not pile up writes either)."""
    now = timezone.now()
    stale = now - TOKEN_TOUCH_INTERVAL
    if token.last_used_at is not None and token.last_used_at > stale:
        return
    updated = ApiToken.objects.filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lte=stale), pk=token.pk
    ).update(last_used_at=now)
    if updated:
        token.last_used_at = now


class ApiTokenScheme(OpenApiAuthenticationExtension):  # type: ignore[no-untyped-call]
    """Documents the bearer token in the OpenAPI schema (and the Authorize button of Swagger UI)."""

    target_class = "common.api.authentication.ApiTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return build_bearer_security_scheme_object(
            header_name="Authorization", token_prefix=BEARER, bearer_format="dynarl API token"
        )
