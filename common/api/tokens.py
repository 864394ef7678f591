"""API token lifecycle: issue (the raw key is returned once) and revoke, each audited."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from common import audit
from common.audit import Actor
from common.models import ApiToken


def issue_token(
    *, user: Any, name: str, actor: Actor, expires_at: datetime | None = None
) -> tuple[ApiToken, str]:
    """Create a token for ``user``; returns it with the raw key, which is never stored."""
    with transaction.atomic():
        token, raw = ApiToken.issue(user, name, expires_at=expires_at)
        audit.record(
            actor,
            "token.create",
            token,
            payload={
                "user": user.get_username(),
                "name": name,
                "key_prefix": token.key_prefix,
                "expires_at": expires_at.isoformat() if expires_at else None,
            },
        )
    return token, raw


def revoke_token(token_id: int, *, actor: Actor, reason: str = "") -> ApiToken:
    """Revoke a token; revoking one that is already revoked changes nothing."""
    with transaction.atomic():
        token = ApiToken.objects.select_for_update().select_related("user").get(pk=token_id)
        if token.revoked_at is None:
            token.revoked_at = timezone.now()
            token.save(update_fields=["revoked_at"])
            audit.record(
                actor,
                "token.revoke",
                token,
                reason=reason,
                payload={
                    "user": token.user.get_username(),
                    "name": token.name,
                    "key_prefix": token.key_prefix,
                },
            )
    return token
