"""Login throttling (issue 11, finding 10: 30 wrong passwords, then the right one, were all
accepted). django-axes counts failed sign-ins per username and client address; past
LOGIN_FAILURE_LIMIT (5) that pair is refused, even with the right password, with a page that says
so, until the cool-off ends or an admin resets it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.apps import apps
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from tests.factories import make_user

pytestmark = pytest.mark.django_db

PASSWORD = "pw-alice"  # what tests.factories.make_user gives "alice"


def sign_in(client: Client, password: str, *, address: str = "127.0.0.1", path: str = "/login/") -> int:
    response = client.post(path, {"username": "alice", "password": password}, REMOTE_ADDR=address)
    return response.status_code


def locked_page(client: Client, address: str = "127.0.0.1") -> str:
    response = client.post("/login/", {"username": "alice", "password": PASSWORD}, REMOTE_ADDR=address)
    assert response.status_code == 429, response.status_code
    return response.content.decode()


def test_thirty_wrong_passwords_lock_the_account_from_that_address_even_for_the_right_one() -> None:
    make_user("alice")
    client = Client()
    assert sign_in(client, "wrong-0") == 200  # the form again, with its error
    for attempt in range(1, 30):
        assert sign_in(client, f"wrong-{attempt}") in (200, 429)
    page = locked_page(client)
    assert "Sign-in locked" in page
    assert "Too many failed sign-ins for <strong>alice</strong> from your address (5 in a row)" in page
    assert "for 15 minutes, even with the right password" in page
    assert "axes_reset_username alice" in page
    assert "_auth_user_id" not in client.session  # not signed in
    response = client.post("/login/", {"username": "alice", "password": PASSWORD})
    assert response["Retry-After"] == "900"

    # The lock is per username and address: alice from elsewhere is not locked out.
    other = Client()
    assert sign_in(other, PASSWORD, address="198.51.100.20") == 302
    assert other.session["_auth_user_id"]


def test_the_lock_lifts_when_an_admin_resets_it() -> None:
    make_user("alice")
    client = Client()
    for attempt in range(5):
        sign_in(client, f"wrong-{attempt}")
    locked_page(client)
    call_command("axes_reset_username", "alice")
    assert sign_in(client, PASSWORD) == 302
    assert client.session["_auth_user_id"]


def test_the_lock_lifts_after_the_cool_off() -> None:
    make_user("alice")
    client = Client()
    for attempt in range(5):
        sign_in(client, f"wrong-{attempt}")
    locked_page(client)
    # The attempts as if made a cool-off (15 minutes) ago.
    apps.get_model("axes", "AccessAttempt").objects.update(
        attempt_time=timezone.now() - timedelta(minutes=15, seconds=1)
    )
    assert sign_in(client, PASSWORD) == 302


def test_the_admin_login_is_throttled_too() -> None:
    make_user("alice", "admin")
    client = Client()
    for attempt in range(5):
        sign_in(client, f"wrong-{attempt}", path="/admin/login/")
    response = client.post("/admin/login/", {"username": "alice", "password": PASSWORD})
    assert response.status_code == 429
    assert "Too many failed sign-ins" in response.content.decode()


def test_a_success_before_the_limit_starts_the_count_again() -> None:
    make_user("alice")
    client = Client()
    for _ in range(2):
        for attempt in range(4):
            assert sign_in(client, f"wrong-{attempt}") == 200
        assert sign_in(client, PASSWORD) == 302
        client.logout()
