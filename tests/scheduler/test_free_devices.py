"""Which devices are free: one answer for admission and the tick, and no device with two owners.

A migration that grows a group into free devices reserves them when it is planned; they are
handed to the new workers only when it commits. Admission, another job's tick and the API's
counts must all treat them as taken from the moment they are reserved.
"""

from __future__ import annotations

import pytest
from django.db import transaction
from django.utils import timezone

from cluster.models import Device, DeviceStatus
from cluster.selectors import free_devices
from common.audit import Actor
from jobs.models import LIVE_WORKER_STATES, Job, JobState
from scheduler.core.decisions import Decision, Reason
from scheduler.core.migration import PlanError
from scheduler.models import Migration, MigrationState, SchedulingDecision
from scheduler.services import gpu_migrations
from scheduler.services.graph import build_hypergraph
from tests.factories import make_cluster, make_user, mark_running, spec, submit
from tests.scheduler.test_gpu_migrations import deliver_all

pytestmark = pytest.mark.django_db


def owned_by(job: Job) -> set[str]:
    return set(
        Device.objects.filter(worker__group__job=job, worker__state__in=LIVE_WORKER_STATES).values_list(
            "uid", flat=True
        )
    )


def grow_into_free(job: Job, group: str, device_uids: list[str]) -> Migration:
    """What the tick does when the policy grows ``group`` into free devices."""
    with transaction.atomic():
        locked = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
        graph = build_hypergraph(locked, taken_at=timezone.now().timestamp())
        decision = Decision(
            policy="test",
            reason=Reason.GROW_INTO_FREE_DEVICES,
            detail=f"{group} grows into {len(device_uids)} free GPUs",
            donor=None,
            recipient=group,
            device_ids=tuple(device_uids),
            donor_strategy=None,
            recipient_strategy=graph.node(group).strategy,
            at=graph.taken_at,
        )
        row = SchedulingDecision.objects.create(
            job=locked,
            policy="test",
            reason=decision.reason.value,
            detail=decision.detail,
            recipient=group,
            device_uids=device_uids,
            chosen=decision.to_json(),
        )
        return gpu_migrations.create_migration(locked, row, decision, graph, actor=Actor.scheduler())


@pytest.fixture
def growing() -> tuple[Job, Migration, set[str]]:
    """A running job on 4 of 8 GPUs whose trainer is growing into 2 of the 4 free ones."""
    make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4)})
    job = mark_running(submit(make_user("alice"), spec("first", rollout=2, actor=2)))
    free = sorted(Device.objects.filter(worker__isnull=True).values_list("uid", flat=True))
    assert len(free) == 4
    reserved = set(free[:2])
    migration = grow_into_free(job, "actor", sorted(reserved))
    assert migration.state == MigrationState.RUNNING
    return job, migration, reserved


def test_a_job_admitted_while_a_migration_grows_into_free_devices_keeps_what_it_was_given(
    growing: tuple[Job, Migration, set[str]],
) -> None:
    first, migration, reserved = growing
    # The second job would fit only on every device nobody owns, reserved ones included.
    second = submit(make_user("bob"), spec("second", rollout=2, actor=2))
    given = owned_by(second)
    assert not given & reserved, "admission handed out devices an open migration reserved"

    deliver_all()
    migration.refresh_from_db()
    assert migration.state == MigrationState.COMMITTED
    second.refresh_from_db()
    # The migration's devices went to the first job; the second keeps whatever it was given.
    assert reserved <= owned_by(first)
    assert owned_by(second) == given
    assert not owned_by(first) & owned_by(second)
    if second.state == JobState.PENDING:
        assert "waiting for devices" in second.state_detail
    # Now the reserved devices are owned, and nothing is left for the second job's 4 GPUs.
    assert not Device.objects.filter(reserved_by__gt="").exists()


def test_reserved_devices_are_not_free_for_anyone_until_the_migration_ends(
    growing: tuple[Job, Migration, set[str]],
) -> None:
    _, migration, reserved = growing
    assert set(Device.objects.filter(reserved_by=migration.migration_id).values_list("uid", flat=True)) == (
        reserved
    )
    free = set(free_devices("sim").values_list("uid", flat=True))
    assert len(free) == 2 and not free & reserved


def test_a_second_migration_cannot_reserve_devices_another_one_holds(
    growing: tuple[Job, Migration, set[str]],
) -> None:
    _, _, reserved = growing
    # Another job's tick that read the free pool before the reservation landed.
    other = mark_running(submit(make_user("carol"), spec("third", rollout=1, actor=1)))
    with pytest.raises(PlanError, match="no longer free"):
        grow_into_free(other, "actor", sorted(reserved))
    assert not Migration.objects.filter(job=other).exists()


def test_a_rolled_back_growth_gives_its_reserved_devices_back_to_the_free_pool(
    growing: tuple[Job, Migration, set[str]],
) -> None:
    first, migration, reserved = growing
    before = owned_by(first)
    deliver_all(fail_kind="start_workers", fail_times=99)
    migration.refresh_from_db()
    assert migration.state in (MigrationState.ROLLED_BACK, MigrationState.FAILED)
    assert owned_by(first) == before
    assert reserved <= set(free_devices("sim").values_list("uid", flat=True))
    assert set(Device.objects.filter(uid__in=reserved).values_list("status", flat=True)) == {
        DeviceStatus.FREE
    }
