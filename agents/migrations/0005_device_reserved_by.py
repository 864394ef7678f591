from typing import Any

from django.db import migrations, models


def reserve_for_open_migrations(apps: Any, schema_editor: Any) -> None:
    # Migrations in flight at upgrade time hold the unowned devices they will hand out.
    Device = apps.get_model("agents", "Device")
    Migration = apps.get_model("scheduler", "Migration")
    for migration_id, device_uids in Migration.objects.filter(
        state__in=["planned", "running", "rolling_back"]
    ).values_list("migration_id", "device_uids"):
        Device.objects.filter(uid__in=device_uids, worker__isnull=True).update(reserved_by=migration_id)


class Migration(migrations.Migration):
    dependencies = [
        ("agents", "0004_node_backends"),
        ("jobs", "0001_initial"),
        ("scheduler", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="device",
            name="reserved_by",
            field=models.CharField(
                blank=True,
                db_index=True,
                default="",
                help_text="the open migration that will hand this free device to a new worker when it commits",
                max_length=128,
            ),
        ),
        migrations.AddConstraint(
            model_name="device",
            constraint=models.CheckConstraint(
                condition=models.Q(("reserved_by", ""), ("worker__isnull", True), _connector="OR"),
                name="device_reserved_only_when_unowned",
            ),
        ),
        migrations.RunPython(reserve_for_open_migrations, migrations.RunPython.noop, elidable=True),
    ]
