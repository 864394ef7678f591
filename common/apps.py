from django.apps import AppConfig


class CommonConfig(AppConfig):
    """The floor every app builds on: the audit trail, API tokens, state transitions, roles, live
    event publishing, the Redis client, request-body limits and the REST API's primitives."""

    name = "common"
    verbose_name = "dynarl common"
