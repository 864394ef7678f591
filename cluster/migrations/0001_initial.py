# Nodes, devices and agent commands, moved here from the agents app: the tables stay as they are
# (state only), and what named them by app now names this one.

import cluster.models
import django.db.models.deletion
import django.utils.timezone
from typing import Any

from django.db import migrations, models

MOVED = ("node", "device", "agentcommand")


def rename_references(apps: Any, schema_editor: Any) -> None:
    # Audit rows and content types that named the models by their old app name.
    AuditEvent = apps.get_model("common", "AuditEvent")
    ContentType = apps.get_model("contenttypes", "ContentType")
    for model in MOVED:
        AuditEvent.objects.filter(object_type=f"agents.{model}").update(object_type=f"cluster.{model}")
        if not ContentType.objects.filter(app_label="cluster", model=model).exists():
            ContentType.objects.filter(app_label="agents", model=model).update(app_label="cluster")


def restore_references(apps: Any, schema_editor: Any) -> None:
    AuditEvent = apps.get_model("common", "AuditEvent")
    ContentType = apps.get_model("contenttypes", "ContentType")
    for model in MOVED:
        AuditEvent.objects.filter(object_type=f"cluster.{model}").update(object_type=f"agents.{model}")
        ContentType.objects.filter(app_label="cluster", model=model).update(app_label="agents")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('contenttypes', '0002_remove_content_type_name'),
        ('common', '0001_initial'),
        ('agents', '0005_device_reserved_by'),
        ('jobs', '0001_initial'),
        ('scheduler', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
        migrations.CreateModel(
            name='Node',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('name', models.CharField(help_text='host name the agent registered with', max_length=200, unique=True)),
                ('status', models.CharField(choices=[('ready', 'Ready'), ('lost', 'Lost'), ('drained', 'Drained')], default='ready', max_length=16)),
                ('backend', models.CharField(default='sim', help_text='execution backend: sim or ray', max_length=16)),
                ('backends', models.JSONField(default=cluster.models.default_backends, help_text="the job backends its agent runs (a job's spec `backend` must be one of them)")),
                ('agent_version', models.CharField(blank=True, default='', max_length=32)),
                ('labels', models.JSONField(blank=True, default=dict)),
                ('registered_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('last_heartbeat_at', models.DateTimeField(blank=True, db_index=True, null=True)),
                ('status_reason', models.TextField(blank=True, default='')),
            ],
            options={
                'db_table': 'agents_node',
                'ordering': ['name'],
            },
        ),
        migrations.CreateModel(
            name='Device',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('index', models.PositiveIntegerField(help_text='index on the host (CUDA ordinal)')),
                ('uid', models.CharField(help_text='cluster-wide id, e.g. node-a/gpu3', max_length=255, unique=True)),
                ('hardware', models.CharField(db_index=True, help_text='hardware type, e.g. H100', max_length=32)),
                ('memory_gb', models.FloatField(default=80.0)),
                ('status', models.CharField(choices=[('free', 'Free'), ('allocated', 'Allocated'), ('lost', 'Lost')], default='free', max_length=16)),
                ('reserved_by', models.CharField(blank=True, db_index=True, default='', help_text='the open migration that will hand this free device to a new worker when it commits', max_length=128)),
                ('utilisation', models.FloatField(default=0.0, help_text='latest reported, 0..1')),
                ('memory_used_gb', models.FloatField(default=0.0)),
                ('reported_at', models.DateTimeField(blank=True, null=True)),
                ('worker', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='devices', to='jobs.worker')),
                ('node', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='devices', to='cluster.node')),
            ],
            options={
                'db_table': 'agents_device',
                'ordering': ['node__name', 'index'],
                'constraints': [models.UniqueConstraint(fields=('node', 'index'), name='device_unique_index_per_node'), models.CheckConstraint(condition=models.Q(('worker__isnull', True), ('status__in', ['allocated', 'lost']), _connector='OR'), name='device_owned_only_when_allocated_or_lost'), models.CheckConstraint(condition=models.Q(('reserved_by', ''), ('worker__isnull', True), _connector='OR'), name='device_reserved_only_when_unowned')],
            },
        ),
        migrations.CreateModel(
            name='AgentCommand',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('command_id', models.CharField(max_length=128, unique=True)),
                ('kind', models.CharField(help_text='launch_workers, stop_workers or migration_step', max_length=32)),
                ('payload', models.JSONField(default=dict)),
                ('state', models.CharField(choices=[('queued', 'Queued'), ('delivered', 'Delivered'), ('done', 'Done'), ('failed', 'Failed'), ('cancelled', 'Cancelled')], default='queued', max_length=16)),
                ('created_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('delivered_at', models.DateTimeField(blank=True, null=True)),
                ('finished_at', models.DateTimeField(blank=True, null=True)),
                ('deliveries', models.PositiveIntegerField(default=0)),
                ('result', models.JSONField(blank=True, default=dict)),
                ('step', models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='commands', to='scheduler.migrationstep')),
                ('node', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='commands', to='cluster.node')),
            ],
            options={
                'db_table': 'agents_agentcommand',
                'ordering': ['created_at', 'id'],
                'indexes': [models.Index(fields=['node', 'state', 'created_at'], name='agents_agen_node_id_e91884_idx')],
            },
        ),
        ]),
        migrations.RunPython(rename_references, restore_references),
    ]
