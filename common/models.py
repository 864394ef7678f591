"""Cross-cutting records: the audit trail and API tokens.

Both tables keep the names they had in the ``controlplane`` app, where they were first created."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone


class ActorType(models.TextChoices):
    USER = "user"
    AGENT = "agent"
    SCHEDULER = "scheduler"
    SYSTEM = "system"


class AuditEvent(models.Model):
    """Who did what to which object, why, and when. Written for every mutation."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor_type = models.CharField(max_length=16, choices=ActorType.choices)
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor = models.CharField(max_length=200, help_text="username, node name or component that acted")
    verb = models.CharField(max_length=64, db_index=True)
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64)
    job = models.ForeignKey(
        "jobs.Job", null=True, blank=True, on_delete=models.CASCADE, related_name="audit_events"
    )
    reason = models.TextField(blank=True, default="")
    payload = models.JSONField(default=dict, blank=True)
    request_id = models.CharField(max_length=64, blank=True, default="", db_index=True)

    class Meta:
        db_table = "controlplane_auditevent"
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["object_type", "object_id", "-at"]),
            models.Index(fields=["job", "-at"]),
            models.Index(fields=["actor_type", "-at"]),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.verb} {self.object_type}:{self.object_id}"


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiToken(models.Model):
    """A bearer token for the REST API and the CLI; acts with its user's role."""

    PREFIX = "dynarl_"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True)
    key_prefix = models.CharField(max_length=16, help_text="first characters, to tell tokens apart")
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "controlplane_apitoken"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.key_prefix}…) of {self.user}"

    @classmethod
    def issue(cls, user: Any, name: str, expires_at: Any = None) -> tuple[ApiToken, str]:
        """Create a token; the raw key is returned once and only its hash is stored."""
        raw = cls.PREFIX + secrets.token_urlsafe(32)
        token = cls.objects.create(
            user=user, name=name, key_hash=hash_token(raw), key_prefix=raw[:12], expires_at=expires_at
        )
        return token, raw

    @property
    def is_active(self) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()
