"""Template context for every page: the viewer's role, which decides what controls are drawn.
The API enforces the same roles; hiding a control is for clarity, not protection."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from common.roles import Role, role_of


def role(request: HttpRequest) -> dict[str, Any]:
    current = role_of(getattr(request, "user", None))
    return {
        "role_name": current.name.lower() if current is not None else "",
        "can_operate": current is not None and current >= Role.OPERATOR,
    }
