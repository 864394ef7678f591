"""ASGI entry point: HTTP through Django, WebSockets (``/ws/...``) through Channels."""

import os

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

# Django must be set up before anything imports models, so this comes first.
django_asgi_app = get_asgi_application()

from controlplane.routing import websocket_application  # noqa: E402 - needs the app registry

application = ProtocolTypeRouter({"http": django_asgi_app, "websocket": websocket_application()})
