"""Roles: admin, operator (submit and steer jobs), viewer (read only).

A superuser, or a member of the ``admin`` group, is an admin; a member of ``operator`` is an
operator; every other authenticated user is a viewer.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class Role(IntEnum):
    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3


ROLE_GROUPS = {"admin": Role.ADMIN, "operator": Role.OPERATOR, "viewer": Role.VIEWER}


def role_of(user: Any) -> Role | None:
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    if user.is_superuser:
        return Role.ADMIN
    cached: Role | None = getattr(user, "_dynarl_role", None)
    if cached is not None:
        return cached
    names = set(user.groups.values_list("name", flat=True))
    role = max((ROLE_GROUPS[n] for n in names if n in ROLE_GROUPS), default=Role.VIEWER)
    user._dynarl_role = role
    return role


def has_role(user: Any, needed: Role) -> bool:
    role = role_of(user)
    return role is not None and role >= needed
