"""The agents' credentials, and the change counter behind the heartbeat reply's job pictures."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from common.models import hash_token


class BootstrapToken(models.Model):
    """Shared secret an agent presents once to register; exchanged for a per-node token."""

    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def matching(cls, raw: str) -> BootstrapToken | None:
        token = cls.objects.filter(key_hash=hash_token(raw), revoked_at__isnull=True).first()
        if token and token.expires_at and token.expires_at <= timezone.now():
            return None
        return token


class NodeToken(models.Model):
    """The credential of one node's agent; it can act for that node only."""

    node = models.OneToOneField("cluster.Node", on_delete=models.CASCADE, related_name="token")
    key_hash = models.CharField(max_length=64, unique=True)
    issued_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"token of {self.node}"


class JobPictureChange(models.Model):
    """One change to what the heartbeat replies of a job's nodes share: the job's iteration, state
    or spec, its groups, its live workers, its open migrations. Database triggers write these
    rows (migration 0003), so every writer counts, bulk updates included;
    ``agents.services.progress`` keeps each job's picture and rebuilds it only when the job's count
    of rows has moved."""

    job_id = models.BigIntegerField(db_index=True, help_text="no foreign key: kept until the job goes")

    def __str__(self) -> str:
        return f"change {self.pk} of job {self.job_id}"
