"""Token endpoints: list, create (raw key once), revoke; own tokens, or anyone's for admins."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from common.models import ApiToken, AuditEvent
from tests.api.conftest import bearer, error_of, field_paths

pytestmark = pytest.mark.django_db


def test_creating_a_token_shows_the_key_once_and_it_works(clients: dict[str, APIClient]) -> None:
    response = clients["viewer"].post(
        "/api/v1/tokens/", {"name": "laptop"}, format="json", HTTP_X_REQUEST_ID="req-token-1"
    )
    assert response.status_code == 201
    created = response.json()
    assert created["key"].startswith("dynarl_")
    assert created["user"] == "viewer"
    assert created["active"] is True
    assert created["key"].startswith(created["key_prefix"])

    token = ApiToken.objects.get(pk=created["id"])
    assert token.key_hash != created["key"]  # only the hash is stored
    listed = clients["viewer"].get(f"/api/v1/tokens/{created['id']}/").json()
    assert "key" not in listed

    assert bearer(created["key"]).get("/api/v1/whoami/").json()["username"] == "viewer"
    event = AuditEvent.objects.get(verb="token.create", object_id=str(created["id"]))
    assert (event.actor, event.request_id) == ("viewer", "req-token-1")
    assert event.payload["name"] == "laptop"


def test_token_input_is_validated_by_field(clients: dict[str, APIClient]) -> None:
    response = clients["viewer"].post(
        "/api/v1/tokens/",
        {"name": "", "expires_at": (timezone.now() - timedelta(days=1)).isoformat()},
        format="json",
    )
    assert response.status_code == 400
    assert sorted(field_paths(response)) == ["expires_at", "name"]
    assert not ApiToken.objects.filter(name="").exists()


def test_users_see_only_their_tokens_and_admins_see_all(
    users: dict[str, User], clients: dict[str, APIClient]
) -> None:
    viewer_tokens = {t["user"] for t in clients["viewer"].get("/api/v1/tokens/").json()["results"]}
    assert viewer_tokens == {"viewer"}
    all_tokens = {t["user"] for t in clients["admin"].get("/api/v1/tokens/").json()["results"]}
    assert all_tokens == {"admin", "operator", "viewer"}
    only = clients["admin"].get("/api/v1/tokens/", {"user": "operator"}).json()
    assert {t["user"] for t in only["results"]} == {"operator"}
    assert only["count"] == 1


def test_a_user_cannot_see_or_revoke_someone_elses_token(
    users: dict[str, User], clients: dict[str, APIClient]
) -> None:
    other = ApiToken.objects.get(user=users["operator"])
    assert clients["viewer"].get(f"/api/v1/tokens/{other.pk}/").status_code == 404
    response = clients["viewer"].post(f"/api/v1/tokens/{other.pk}/revoke/", {}, format="json")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"
    other.refresh_from_db()
    assert other.revoked_at is None


def test_revoking_stops_the_token_at_once_and_is_audited_once(users: dict[str, User]) -> None:
    token, raw = ApiToken.issue(users["operator"], "ci")
    _, own_raw = ApiToken.issue(users["operator"], "admin-of-self")
    client = bearer(own_raw)
    response = client.post(f"/api/v1/tokens/{token.pk}/revoke/", {"reason": "leaked"}, format="json")
    assert response.status_code == 200
    assert response.json()["active"] is False
    assert bearer(raw).get("/api/v1/whoami/").status_code == 401

    again = client.post(f"/api/v1/tokens/{token.pk}/revoke/", {}, format="json")
    assert again.status_code == 200
    events = AuditEvent.objects.filter(verb="token.revoke", object_id=str(token.pk))
    assert [(e.actor, e.reason) for e in events] == [("operator", "leaked")]


def test_admins_manage_anyones_tokens(users: dict[str, User], clients: dict[str, APIClient]) -> None:
    created = clients["admin"].post(
        "/api/v1/tokens/", {"name": "for viewer", "user": "viewer"}, format="json"
    )
    assert created.status_code == 201
    assert created.json()["user"] == "viewer"
    assert bearer(created.json()["key"]).get("/api/v1/whoami/").json()["username"] == "viewer"

    viewer_token = ApiToken.objects.filter(user=users["viewer"]).exclude(pk=created.json()["id"]).get()
    revoked = clients["admin"].post(f"/api/v1/tokens/{viewer_token.pk}/revoke/", {}, format="json")
    assert revoked.status_code == 200
    event = AuditEvent.objects.get(verb="token.revoke")
    assert (event.actor, event.payload["user"]) == ("admin", "viewer")


def test_only_admins_issue_tokens_for_others(clients: dict[str, APIClient]) -> None:
    response = clients["operator"].post("/api/v1/tokens/", {"name": "x", "user": "viewer"}, format="json")
    assert response.status_code == 403
    assert error_of(response)["code"] == "permission_denied"
    assert not ApiToken.objects.filter(name="x").exists()
    missing = clients["admin"].post("/api/v1/tokens/", {"name": "x", "user": "nobody"}, format="json")
    assert missing.status_code == 400
    assert field_paths(missing) == ["user"]


def test_anonymous_cannot_touch_tokens(clients: dict[str, APIClient], users: dict[str, User]) -> None:
    anonymous = clients["anonymous"]
    token = ApiToken.objects.get(user=users["viewer"])
    assert anonymous.get("/api/v1/tokens/").status_code == 401
    assert anonymous.post("/api/v1/tokens/", {"name": "x"}, format="json").status_code == 401
    assert anonymous.post(f"/api/v1/tokens/{token.pk}/revoke/", {}, format="json").status_code == 401
