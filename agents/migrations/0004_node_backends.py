from typing import Any

from django.db import migrations, models

import cluster.models


def backends_from_backend(apps: Any, schema_editor: Any) -> None:
    # A node registered before agents said which backends they offer offers the one it runs.
    Node = apps.get_model("agents", "Node")
    for node in Node.objects.exclude(backend="sim").only("pk", "backend"):
        Node.objects.filter(pk=node.pk).update(backends=[node.backend])


class Migration(migrations.Migration):
    dependencies = [
        ("agents", "0003_device_lost_with_owner_and_job_picture_changes"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="backends",
            field=models.JSONField(
                default=cluster.models.default_backends,
                help_text="the job backends its agent runs (a job's spec `backend` must be one of them)",
            ),
        ),
        migrations.RunPython(backends_from_backend, migrations.RunPython.noop, elidable=True),
    ]
