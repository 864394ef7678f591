from __future__ import annotations

import pytest
from django.test import Client

from tests.factories import make_user

pytestmark = pytest.mark.django_db


def test_swagger_ui_is_served_from_this_server_not_a_cdn(client: Client) -> None:
    client.force_login(make_user("viewer-v", role="viewer"))
    response = client.get("/api/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "drf_spectacular_sidecar" in html
    assert "cdn." not in html and "unpkg" not in html
