# The audit trail and API tokens now belong to the common app (common 0001 takes them over);
# their tables stay, so only the migration state forgets them here.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("controlplane", "0001_initial"),
        ("common", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name="ApiToken"),
                migrations.DeleteModel(name="AuditEvent"),
            ]
        ),
    ]
