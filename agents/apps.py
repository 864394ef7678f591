from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "agents"

    def ready(self) -> None:
        # Connects the post_save receiver that wakes long-polling agents when a command is queued,
        # in every process that can queue one (web server, Celery workers, management commands);
        # imported here, not at the top, because its module imports models (the app registry must be
        # ready first).
        from agents.services import delivery  # noqa: F401
