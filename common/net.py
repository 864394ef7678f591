"""The client's address as this deployment trusts it.

``controlplane.asgi`` applies X-Forwarded-For only when the peer is one of ``TRUSTED_PROXIES``, so
``REMOTE_ADDR`` already is the real client behind a trusted proxy and the peer itself otherwise.
Everything that decides by address (login throttling, the /metrics allow-list) reads it here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from django.http import HttpRequest


def client_ip(request: HttpRequest) -> str:
    """The client's IP address ("" when the server was reached over a Unix socket)."""
    return str(request.META.get("REMOTE_ADDR") or "")


def address_in(address: str, networks: Iterable[str]) -> bool:
    """Whether ``address`` lies in one of ``networks`` (addresses or CIDRs); False for no address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(network, strict=False) for network in networks)
