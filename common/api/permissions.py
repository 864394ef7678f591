"""Role checks for the API: viewer (read), operator (submit and steer jobs), admin (everything).

Anonymous requests fail with 401 (DRF turns a refused permission into NotAuthenticated when no
credentials were given); authenticated users without the role get 403 naming the role needed.
"""

# mypy: disallow-subclassing-any=False
# (rest_framework ships no type information; its base classes are Any.)

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from common.roles import Role, has_role


class RolePermission(BasePermission):
    """Reads need ``read_role``; every other method needs ``write_role``."""

    read_role = Role.VIEWER
    write_role = Role.OPERATOR
    message = "permission denied"

    def has_permission(self, request: Request, view: Any) -> bool:
        needed = self.read_role if request.method in SAFE_METHODS else self.write_role
        if has_role(request.user, needed):
            return True
        self.message = f"this needs the {needed.name.lower()} role"
        return False


class ViewerReadOperatorWrite(RolePermission):
    """The default: anyone with a role reads; operators and admins change things."""


class AnyRole(RolePermission):
    """Any authenticated user, for what concerns only themselves (their tokens, whoami)."""

    write_role = Role.VIEWER


class AdminOnly(RolePermission):
    read_role = Role.ADMIN
    write_role = Role.ADMIN
