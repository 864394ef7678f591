"""The agent protocol, version 1, mounted under /api/v1/ (docs/agent-protocol.md)."""

from django.urls import URLPattern, URLResolver, path

from agents import protocol

urlpatterns: list[URLPattern | URLResolver] = [
    path("agent/register", protocol.register, name="agent-register"),
    path("agent/heartbeat", protocol.heartbeat, name="agent-heartbeat"),
    path("agent/commands", protocol.commands, name="agent-commands"),
    # Ids hold ':', '@' and '#': agents percent-encode them; <path:> also admits an encoded '/'.
    path("agent/commands/<path:command_id>/report", protocol.report_command, name="agent-command-report"),
    path("agent/steps/<path:step_id>/report", protocol.report_step, name="agent-step-report"),
]
