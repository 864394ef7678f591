# Nodes moved to the cluster app with their table: the relations' state follows, nothing else.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('cluster', '0001_initial'),
        ('scheduler', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
        migrations.AlterField(
            model_name='alert',
            name='node',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='alerts', to='cluster.node'),
        ),
        migrations.AlterField(
            model_name='telemetrysample',
            name='node',
            field=models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='+', to='cluster.node'),
        ),
        ]),
    ]
