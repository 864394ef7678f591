"""ASGI entry point: HTTP through Django, WebSockets (``/ws/...``) through Channels.

Proxy headers: X-Forwarded-For and X-Forwarded-Proto are applied to the scope only when the
connecting peer is one of ``TRUSTED_PROXIES`` (uvicorn's middleware, which works under any ASGI
server); daphne runs without ``--proxy-headers``, which would believe them from anyone.
"""

import os

from channels.routing import ProtocolTypeRouter
from django.conf import settings
from django.core.asgi import get_asgi_application
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

# Django must be set up before anything imports models, so this comes first.
django_asgi_app = get_asgi_application()

from controlplane.routing import websocket_application  # noqa: E402 - needs the app registry

application = ProxyHeadersMiddleware(
    ProtocolTypeRouter({"http": django_asgi_app, "websocket": websocket_application()}),
    trusted_hosts=list(settings.TRUSTED_PROXIES),
)
