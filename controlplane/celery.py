"""The Celery app. Workers and beat start with ``celery -A controlplane worker|beat``."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("dynarl")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
