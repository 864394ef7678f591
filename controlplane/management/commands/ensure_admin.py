"""Create the first admin account if there is none (idempotent)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = (
        "Create the admin account from DYNARL_ADMIN_USERNAME / DYNARL_ADMIN_PASSWORD, or with a generated "
        "password written to <data dir>/admin-password, unless a superuser already exists."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--username", default="admin")
        parser.add_argument("--password", default=None)
        parser.add_argument("--email", default="")

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        username: str = options["username"]
        password_file = Path(settings.DATA_DIR) / "admin-password"
        if user_model.objects.filter(is_superuser=True).exists():
            self.stdout.write(f"admin account exists; log in at /admin/ as {self._existing_admin()}")
            if password_file.exists():
                self.stdout.write(f"(generated password kept in {password_file})")
            return
        password: str | None = options["password"]
        if not password:
            password = secrets.token_urlsafe(12)
            password_file.parent.mkdir(parents=True, exist_ok=True)
            password_file.write_text(password + "\n")
            password_file.chmod(0o600)
            self.stdout.write(f"generated password written to {password_file}")
        user_model.objects.create_superuser(username=username, email=options["email"], password=password)
        self.stdout.write(f"created admin account: log in at /admin/ as {username} / {password}")

    def _existing_admin(self) -> str:
        admin = get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
        return admin.get_username() if admin else "?"
