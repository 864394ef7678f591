# Devices moved to the cluster app with their table: the relation's state follows, nothing else.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('cluster', '0001_initial'),
        ('jobs', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
        migrations.AlterField(
            model_name='worker',
            name='colocated_devices',
            field=models.ManyToManyField(blank=True, related_name='colocated_workers', to='cluster.device'),
        ),
        ]),
    ]
