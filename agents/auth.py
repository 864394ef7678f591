"""Credentials of node agents: bootstrap tokens to register, node tokens for everything after.

Agents send ``Authorization: Bearer <token>``. A node token acts for its own node only, and is
accepted by the agent protocol only: it is not an ApiToken, so user endpoints refuse it, and
agent endpoints look up NodeTokens only, so a user's ApiToken or session is refused here.
"""

from __future__ import annotations

import secrets

from django.db import connection
from django.http import HttpRequest
from django.utils import timezone

from agents.models import BootstrapToken, NodeToken
from cluster.models import Node
from common.models import hash_token

NODE_TOKEN_PREFIX = "dynarl_node_"


class AgentAuthError(Exception):
    """Missing, unknown or revoked credentials (HTTP 401)."""


def bearer(request: HttpRequest) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, raw = header.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise AgentAuthError("send the agent's token as 'Authorization: Bearer <token>'")
    return raw.strip()


def bootstrap_token(request: HttpRequest) -> BootstrapToken:
    token = BootstrapToken.matching(bearer(request))
    if token is None:
        raise AgentAuthError("unknown, expired or revoked bootstrap token")
    return token


def node_for_token(raw: str) -> Node:
    # Every heartbeat comes through here: a plain statement skips the ORM's query compilation.
    node_table = connection.ops.quote_name(Node._meta.db_table)
    token_table = connection.ops.quote_name(NodeToken._meta.db_table)
    found = list(
        Node.objects.raw(
            f"SELECT n.* FROM {node_table} n JOIN {token_table} t ON t.node_id = n.id WHERE t.key_hash = %s",
            [hash_token(raw)],
        )
    )
    if not found:
        raise AgentAuthError("unknown node token; register again with a bootstrap token")
    return found[0]


def authenticate_node(request: HttpRequest) -> Node:
    """The node whose agent sent ``request``; raises AgentAuthError."""
    return node_for_token(bearer(request))


def issue_node_token(node: Node) -> str:
    """Create or rotate the node's token; the raw key is returned once, only its hash is kept."""
    raw = NODE_TOKEN_PREFIX + secrets.token_urlsafe(32)
    NodeToken.objects.update_or_create(
        node=node, defaults={"key_hash": hash_token(raw), "issued_at": timezone.now()}
    )
    return raw
