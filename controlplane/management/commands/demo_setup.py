"""Credentials for the live demo: an agent bootstrap token and an operator's API token.

Idempotent: the raw secrets are kept in the data directory (0600) and reused on the next run.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import Group, User
from django.core.management.base import BaseCommand

from agents.models import BootstrapToken
from common import audit
from common.api.tokens import issue_token
from common.audit import Actor
from common.models import ApiToken, hash_token

BOOTSTRAP_FILE = "agent-bootstrap-token"
DEMO_TOKEN_FILE = "demo-api-token"
DEMO_USER = "demo-operator"


def _write_secret(path: Path, value: str) -> None:
    path.write_text(value + "\n")
    path.chmod(0o600)


class Command(BaseCommand):
    help = "Create (once) the demo agents' bootstrap token and the demo operator's API token."

    def handle(self, *args: Any, **options: Any) -> None:
        data_dir = Path(settings.DATA_DIR)
        data_dir.mkdir(parents=True, exist_ok=True)
        actor = Actor.system("demo setup")

        bootstrap_path = data_dir / BOOTSTRAP_FILE
        if (
            not bootstrap_path.exists()
            or not BootstrapToken.objects.filter(
                key_hash=hash_token(bootstrap_path.read_text().strip()), revoked_at__isnull=True
            ).exists()
        ):
            raw = "dynarl_boot_" + secrets.token_urlsafe(24)
            token = BootstrapToken.objects.create(name="demo agents", key_hash=hash_token(raw))
            audit.record(actor, "bootstrap_token.create", token, reason="demo agents")
            _write_secret(bootstrap_path, raw)
            self.stdout.write(f"agent bootstrap token written to {bootstrap_path}")

        token_path = data_dir / DEMO_TOKEN_FILE
        user, _ = User.objects.get_or_create(username=DEMO_USER)
        operators, _ = Group.objects.get_or_create(name="operator")
        user.groups.add(operators)
        if (
            not token_path.exists()
            or not ApiToken.objects.filter(
                key_hash=hash_token(token_path.read_text().strip()), revoked_at__isnull=True
            ).exists()
        ):
            _, raw = issue_token(user=user, name="demo", actor=actor)
            _write_secret(token_path, raw)
            self.stdout.write(f"demo operator's API token written to {token_path}")
