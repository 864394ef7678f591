from django.apps import AppConfig


class ClusterConfig(AppConfig):
    """Nodes, devices and the commands queued for their agents: what every app reads to know who
    holds which GPU, below the jobs, the scheduler and the agent protocol."""

    name = "cluster"
    verbose_name = "dynarl cluster"
