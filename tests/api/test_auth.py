"""Authentication: bearer API tokens and browser sessions; everything else is 401."""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from agents.models import NodeToken
from cluster.models import Node
from common.models import ApiToken, hash_token
from tests.api.conftest import bearer, error_of

pytestmark = pytest.mark.django_db


def test_a_valid_token_acts_as_its_user(users: dict[str, User]) -> None:
    _, raw = ApiToken.issue(users["operator"], "cli")
    response = bearer(raw).get("/api/v1/whoami/")
    assert response.status_code == 200
    assert response.json()["username"] == "operator"
    assert response.json()["role"] == "operator"
    assert response.json()["authentication"] == "token"
    assert response.json()["token"]["name"] == "cli"


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("Bearer dynarl_not-a-real-token", "invalid token"),
        ("Bearer", "malformed"),
        ("Bearer two parts", "malformed"),
    ],
)
def test_bad_bearer_headers_are_refused_with_401(users: dict[str, User], header: str, message: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=header)
    response = client.get("/api/v1/jobs/")
    assert response.status_code == 401
    error = error_of(response)
    assert error["code"] == "authentication_failed"
    assert message in error["message"]
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_revoked_expired_and_inactive_tokens_are_refused(users: dict[str, User]) -> None:
    revoked, revoked_raw = ApiToken.issue(users["viewer"], "old")
    revoked.revoked_at = timezone.now()
    revoked.save()
    _, expired_raw = ApiToken.issue(
        users["viewer"], "short", expires_at=timezone.now() - timedelta(seconds=1)
    )
    inactive_user = User.objects.create_user("gone", password="x")
    _, inactive_raw = ApiToken.issue(inactive_user, "gone")
    inactive_user.is_active = False
    inactive_user.save()

    for raw, reason in ((revoked_raw, "revoked"), (expired_raw, "expired"), (inactive_raw, "inactive")):
        response = bearer(raw).get("/api/v1/whoami/")
        assert response.status_code == 401, reason
        assert reason in error_of(response)["message"]


def test_a_node_agent_token_is_not_a_user_credential(cluster: list[Node]) -> None:
    raw = "dynarl_node_" + secrets.token_urlsafe(32)
    NodeToken.objects.create(node=cluster[0], key_hash=hash_token(raw))
    for url in ("/api/v1/jobs/", "/api/v1/nodes/", "/api/v1/whoami/", "/api/v1/cluster/"):
        response = bearer(raw).get(url)
        assert response.status_code == 401, url
        assert error_of(response)["code"] == "authentication_failed"
    assert bearer(raw).post("/api/v1/jobs/", {}, format="json").status_code == 401


def test_anonymous_requests_get_401_with_a_bearer_challenge(db: Any) -> None:
    response = APIClient().get("/api/v1/jobs/")
    assert response.status_code == 401
    assert error_of(response)["code"] == "not_authenticated"
    assert response["WWW-Authenticate"] == 'Bearer realm="api"'


def test_last_used_is_recorded_but_written_at_most_once_a_minute(users: dict[str, User]) -> None:
    token, raw = ApiToken.issue(users["viewer"], "cli")
    client = bearer(raw)
    assert token.last_used_at is None

    client.get("/api/v1/whoami/")
    token.refresh_from_db()
    assert token.last_used_at is not None

    recent = timezone.now() - timedelta(seconds=10)
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=recent)
    client.get("/api/v1/whoami/")
    token.refresh_from_db()
    assert token.last_used_at == recent  # within the interval: not rewritten

    old = timezone.now() - timedelta(hours=2)
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=old)
    client.get("/api/v1/whoami/")
    token.refresh_from_db()
    assert token.last_used_at > old


def test_a_browser_session_works_and_writes_need_the_csrf_token(users: dict[str, User]) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(users["operator"])
    whoami = client.get("/api/v1/whoami/")
    assert whoami.status_code == 200
    assert whoami.json() | {"groups": None} == {
        "username": "operator",
        "role": "operator",
        "is_superuser": False,
        "groups": None,
        "authentication": "session",
        "token": None,
    }
    refused = client.post("/api/v1/tokens/", {"name": "from the browser"}, format="json")
    assert refused.status_code == 403
    assert "CSRF" in error_of(refused)["message"]


@pytest.mark.parametrize(
    ("role", "expected"), [("admin", "admin"), ("operator", "operator"), ("viewer", "viewer")]
)
def test_whoami_reports_the_role(clients: dict[str, APIClient], role: str, expected: str) -> None:
    assert clients[role].get("/api/v1/whoami/").json()["role"] == expected


def test_a_user_in_no_role_group_is_a_viewer(db: Any) -> None:
    plain = User.objects.create_user("plain", password="x")
    _, raw = ApiToken.issue(plain, "cli")
    client = bearer(raw)
    assert client.get("/api/v1/whoami/").json()["role"] == "viewer"
    assert client.get("/api/v1/jobs/").status_code == 200
    assert client.post("/api/v1/jobs/", {}, format="json").status_code == 403
