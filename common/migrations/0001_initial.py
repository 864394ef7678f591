# The audit trail and API tokens, moved here from the controlplane app: the tables stay as they
# are (state only), and what named them by app now names this one.

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from typing import Any

from django.db import migrations, models

MOVED = ("apitoken", "auditevent")


def rename_references(apps: Any, schema_editor: Any) -> None:
    # Audit rows and content types that named the models by their old app name.
    AuditEvent = apps.get_model("common", "AuditEvent")
    ContentType = apps.get_model("contenttypes", "ContentType")
    for model in MOVED:
        AuditEvent.objects.filter(object_type=f"controlplane.{model}").update(object_type=f"common.{model}")
        if not ContentType.objects.filter(app_label="common", model=model).exists():
            ContentType.objects.filter(app_label="controlplane", model=model).update(app_label="common")


def restore_references(apps: Any, schema_editor: Any) -> None:
    AuditEvent = apps.get_model("common", "AuditEvent")
    ContentType = apps.get_model("contenttypes", "ContentType")
    for model in MOVED:
        AuditEvent.objects.filter(object_type=f"common.{model}").update(object_type=f"controlplane.{model}")
        ContentType.objects.filter(app_label="common", model=model).update(app_label="controlplane")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('controlplane', '0001_initial'),
        ('contenttypes', '0002_remove_content_type_name'),
        ('jobs', '0001_initial'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
        migrations.CreateModel(
            name='ApiToken',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(max_length=100)),
                ('key_hash', models.CharField(max_length=64, unique=True)),
                ('key_prefix', models.CharField(help_text='first characters, to tell tokens apart', max_length=16)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('last_used_at', models.DateTimeField(blank=True, null=True)),
                ('expires_at', models.DateTimeField(blank=True, null=True)),
                ('revoked_at', models.DateTimeField(blank=True, null=True)),
                ('user', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='api_tokens', to=settings.AUTH_USER_MODEL)),
            ],
            options={
                'db_table': 'controlplane_apitoken',
                'ordering': ['-created_at'],
            },
        ),
        migrations.CreateModel(
            name='AuditEvent',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('at', models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                ('actor_type', models.CharField(choices=[('user', 'User'), ('agent', 'Agent'), ('scheduler', 'Scheduler'), ('system', 'System')], max_length=16)),
                ('actor', models.CharField(help_text='username, node name or component that acted', max_length=200)),
                ('verb', models.CharField(db_index=True, max_length=64)),
                ('object_type', models.CharField(max_length=64)),
                ('object_id', models.CharField(max_length=64)),
                ('reason', models.TextField(blank=True, default='')),
                ('payload', models.JSONField(blank=True, default=dict)),
                ('request_id', models.CharField(blank=True, db_index=True, default='', max_length=64)),
                ('actor_user', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to=settings.AUTH_USER_MODEL)),
                ('job', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='audit_events', to='jobs.job')),
            ],
            options={
                'db_table': 'controlplane_auditevent',
                'ordering': ['-at', '-id'],
                'indexes': [models.Index(fields=['object_type', 'object_id', '-at'], name='controlplan_object__afd789_idx'), models.Index(fields=['job', '-at'], name='controlplan_job_id_b04f6b_idx'), models.Index(fields=['actor_type', '-at'], name='controlplan_actor_t_928f5a_idx')],
            },
        ),
            ]),
        migrations.RunPython(rename_references, restore_references),
    ]
