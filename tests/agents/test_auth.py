"""Agent and user credentials never cross: node tokens work only on the agent protocol, and user
tokens or sessions never work there."""

from __future__ import annotations

import contextlib

import pytest
from django.test import Client, RequestFactory
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request
from rest_framework.settings import api_settings

from cluster.models import AgentCommand, CommandState
from common.models import ApiToken
from tests.agents.conftest import Agent, register
from tests.factories import make_user, spec, submit

pytestmark = pytest.mark.django_db


@pytest.fixture
def agent(client: Client, bootstrap: str) -> Agent:
    return register(client, bootstrap, "node-a", gpus=4)[0]


def agent_requests(client: Client, headers: dict[str, str], command_id: str) -> list[int]:
    return [
        client.post(
            "/api/v1/agent/heartbeat", data={"sent_at": 1.0}, content_type="application/json", headers=headers
        ).status_code,
        client.get("/api/v1/agent/commands?wait=0", headers=headers).status_code,
        client.post(
            f"/api/v1/agent/commands/{command_id}/report",
            data={"ok": True},
            content_type="application/json",
            headers=headers,
        ).status_code,
        client.post(
            "/api/v1/agent/register",
            data={"host": "x", "devices": []},
            content_type="application/json",
            headers=headers,
        ).status_code,
    ]


def test_user_credentials_are_refused_on_agent_endpoints(client: Client, agent: Agent) -> None:
    admin = make_user("root", role="admin")
    submit(admin, spec(rollout=2, actor=2))
    command = AgentCommand.objects.get()
    _, raw = ApiToken.issue(admin, "cli")

    assert agent_requests(client, {"Authorization": f"Bearer {raw}"}, command.command_id) == [401] * 4
    client.force_login(admin)
    assert agent_requests(client, {}, command.command_id) == [401] * 4
    command.refresh_from_db()
    assert command.state == CommandState.QUEUED


def test_node_token_is_refused_on_user_endpoints(client: Client, agent: Agent) -> None:
    request = Request(RequestFactory().get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {agent.token}"))
    for authenticator_class in api_settings.DEFAULT_AUTHENTICATION_CLASSES:
        with contextlib.suppress(AuthenticationFailed):
            assert authenticator_class().authenticate(request) is None, authenticator_class
    response = client.get("/api/v1/jobs/", headers=agent.headers())
    assert response.status_code == 401


def test_malformed_authorization_is_refused(client: Client, agent: Agent) -> None:
    for header in ("", "Bearer", "Token " + agent.token, "Basic dXNlcjpwdw=="):
        response = client.post(
            "/api/v1/agent/heartbeat",
            data={"sent_at": 1.0},
            content_type="application/json",
            headers={"Authorization": header} if header else {},
        )
        assert response.status_code == 401, header
        assert response["WWW-Authenticate"].startswith("Bearer")
