"""A worker killed in the middle of a tick leaves no partial rows, and the next tick decides."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from django.db import connection

from scheduler.models import Migration, SchedulingDecision, Tick
from scheduler.services import tick
from tests.scheduler.test_tick import idle_rollout_busy_trainer_job
from tests.services import REPO_ROOT, wait_until

# The child runs a real tick in its own process and parks right after the decision row is
# written (inside the tick's transaction), so the parent can kill it at that point.
CHILD = textwrap.dedent(
    """
    import sys, time, django
    django.setup()
    from scheduler.services import tick
    real_start = tick._start

    def start_then_park(*args, **kwargs):
        started = real_start(*args, **kwargs)
        print("PARKED", flush=True)
        time.sleep(600)
        return started

    tick._start = start_then_park
    tick.run_tick(int(sys.argv[1]))
    """
)


@pytest.mark.django_db(transaction=True)
def test_a_tick_killed_mid_transaction_writes_nothing_and_the_next_one_decides() -> None:
    job = idle_rollout_busy_trainer_job()
    env = dict(os.environ)
    env["DATABASE_URL"] = (
        f"postgres://{connection.settings_dict['USER']}@{connection.settings_dict['HOST'] or '127.0.0.1'}:"
        f"{connection.settings_dict['PORT'] or 5432}/{connection.settings_dict['NAME']}"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(job.pk)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert child.stdout is not None
        # Start-up may log first; the child's output ends (EOF) if it dies before parking.
        seen = []
        for line in child.stdout:
            if line.strip() == "PARKED":
                break
            seen.append(line)
        else:
            pytest.fail("the child ended before parking:\n" + "".join(seen)[-2000:])
        # The decision and migration exist inside the child's open transaction, invisible here.
        assert not SchedulingDecision.objects.filter(job=job).exists()
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    # PostgreSQL rolled the whole tick back: no tick, decision, migration or step rows.
    assert not Tick.objects.filter(job=job).exists()
    assert not SchedulingDecision.objects.filter(job=job).exists()
    assert not Migration.objects.filter(job=job).exists()
    # The row lock died with the connection: the next tick claims the job and decides once.
    assert wait_until(lambda: tick.run_tick(job.pk) is not None, timeout_s=10)
    assert SchedulingDecision.objects.filter(job=job).count() == 1
    assert Migration.objects.filter(job=job).count() == 1
