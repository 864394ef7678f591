from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "agents"

    def ready(self) -> None:
        # Connects the receiver that wakes long-polling agents when a command is queued, in every
        # process that can queue one (web server, Celery workers, management commands).
        from agents import services  # noqa: F401
