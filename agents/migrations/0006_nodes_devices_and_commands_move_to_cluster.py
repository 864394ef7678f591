# Nodes, devices and agent commands now belong to the cluster app (cluster 0001 takes them over);
# their tables stay, so only the migration state forgets them here.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('agents', '0005_device_reserved_by'),
        ('cluster', '0001_initial'),
        ('jobs', '0002_alter_worker_colocated_devices'),
        ('scheduler', '0002_alter_alert_node_alter_telemetrysample_node'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
        migrations.RemoveField(
            model_name='agentcommand',
            name='node',
        ),
        migrations.RemoveField(
            model_name='agentcommand',
            name='step',
        ),
        migrations.RemoveField(
            model_name='device',
            name='node',
        ),
        migrations.RemoveField(
            model_name='device',
            name='worker',
        ),
        migrations.AlterField(
            model_name='nodetoken',
            name='node',
            field=models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='token', to='cluster.node'),
        ),
        migrations.DeleteModel(
            name='AgentCommand',
        ),
        migrations.DeleteModel(
            name='Device',
        ),
        migrations.DeleteModel(
            name='Node',
        ),
        ]),
    ]
