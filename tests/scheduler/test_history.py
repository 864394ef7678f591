"""A job's history on its page: the GPU ownership timeline rebuilt from worker rows, snapshots
and migrations, and per-group telemetry over time from the downsampled buckets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from cluster.models import Device
from common.audit import Actor
from jobs import services
from jobs.models import IterationResult, Job, Worker, WorkerState
from scheduler import selectors
from scheduler.core.hypergraph import ComponentKind
from scheduler.models import MigrationState, PlacementChange, PlacementChangeState, TelemetrySample
from scheduler.services import gpu_migrations, snapshots
from tests.factories import make_cluster, make_user, mark_running, spec, submit
from tests.scheduler.test_gpu_migrations import deliver_all

pytestmark = pytest.mark.django_db


@pytest.fixture
def running_job() -> Job:
    make_cluster({"node-a": ("H100", 4), "node-b": ("H100", 4)})
    return mark_running(submit(make_user("alice"), spec(rollout=6, actor=2)))


def holders(timeline: selectors.Timeline) -> dict[str, list[tuple[str, str, bool]]]:
    """device -> [(group, worker, still holding)] in time order."""
    found: dict[str, list[tuple[str, str, bool]]] = {}
    for segment in timeline.segments:
        found.setdefault(segment.device, []).append((segment.group, segment.worker, segment.end is None))
    return found


def initial_owner(job: Job) -> dict[str, tuple[str, str]]:
    return {
        d.uid: (d.worker.group.name, d.worker.name)
        for d in Device.objects.filter(worker__group__job=job).select_related("worker__group")
    }


def test_a_running_job_holds_each_device_from_admission(running_job: Job) -> None:
    owners = initial_owner(running_job)
    timeline = selectors.job_timeline(running_job)

    assert [d.uid for d in timeline.devices] == sorted(owners)  # node, then index
    assert holders(timeline) == {uid: [(group, worker, True)] for uid, (group, worker) in owners.items()}
    assert {s.kind for s in timeline.segments} == {"rollout", "actor"}
    assert all(s.start >= running_job.submitted_at for s in timeline.segments)
    assert timeline.start <= min(s.start for s in timeline.segments)
    assert timeline.migrations == ()


def test_a_committed_migration_hands_the_moved_devices_over(running_job: Job) -> None:
    owners = initial_owner(running_job)
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    deliver_all()
    migration.refresh_from_db()
    assert migration.state == MigrationState.COMMITTED
    moved = set(migration.device_uids)
    assert migration.finished_at is not None

    timeline = selectors.job_timeline(running_job)
    by_device = holders(timeline)
    for uid, (group, worker) in owners.items():
        if uid not in moved:
            assert by_device[uid] == [(group, worker, True)]
            continue
        # The rollout worker that had it stopped at the commit; a new actor worker holds it since.
        assert len(by_device[uid]) == 2
        (first_group, first_worker, first_open), (then_group, then_worker, then_open) = by_device[uid]
        assert (first_group, first_worker, first_open) == ("rollout", worker, False)
        assert then_group == "actor" and then_open and then_worker != worker
        new_owner = Device.objects.get(uid=uid).worker
        assert new_owner is not None and new_owner.name == then_worker
        donor_segment, recipient_segment = [s for s in timeline.segments if s.device == uid]
        assert donor_segment.end is not None and donor_segment.end <= recipient_segment.start + timedelta(
            seconds=1
        )
        assert donor_segment.end >= migration.created_at

    (mark,) = timeline.migrations
    assert mark.migration_id == migration.migration_id
    assert mark.state == MigrationState.COMMITTED
    assert set(mark.device_uids) == moved
    assert (mark.donor, mark.recipient) == ("rollout", "actor")
    assert mark.finished_at == migration.finished_at


def test_a_rolled_back_migration_leaves_the_owners_alone(running_job: Job) -> None:
    owners = initial_owner(running_job)
    migration = gpu_migrations.request_manual_migration(
        running_job.pk, donor="rollout", recipient="actor", workers=2, actor=Actor.for_user(running_job.owner)
    )
    deliver_all(fail_kind="take_back_requests")
    migration.refresh_from_db()
    assert migration.state == MigrationState.ROLLED_BACK

    timeline = selectors.job_timeline(running_job)
    assert holders(timeline) == {uid: [(group, worker, True)] for uid, (group, worker) in owners.items()}
    (mark,) = timeline.migrations
    assert mark.state == MigrationState.ROLLED_BACK and set(mark.device_uids) == set(migration.device_uids)


def test_stopped_workers_keep_their_history_from_the_snapshots(running_job: Job) -> None:
    owners = initial_owner(running_job)
    snapshots.take(running_job, cause="admission")
    services.cancel_job(running_job.pk, Actor.system("test"))
    # What the agents' stop reports do: the workers stop and their devices are free again.
    stopped_at = timezone.now()
    for worker in Worker.objects.filter(group__job=running_job):
        Device.objects.filter(worker=worker).update(worker=None, status="free")
        worker.state, worker.stopped_at = WorkerState.STOPPED, stopped_at
        worker.save(update_fields=["state", "stopped_at"])
    assert not Device.objects.filter(worker__isnull=False).exists()
    running_job.refresh_from_db()

    timeline = selectors.job_timeline(running_job)
    assert holders(timeline) == {uid: [(group, worker, False)] for uid, (group, worker) in owners.items()}
    assert {s.end for s in timeline.segments} == {stopped_at}
    assert running_job.finished_at is not None and timeline.end == running_job.finished_at


def test_a_job_never_admitted_has_an_empty_timeline(running_job: Job) -> None:
    job = submit(make_user("bob"), spec(rollout=1, actor=1))  # every GPU is taken: it waits
    assert job.state == "pending"
    timeline = selectors.job_timeline(job)
    assert (timeline.devices, timeline.segments, timeline.migrations) == ((), (), ())


# --- telemetry per group -----------------------------------------------------------------------


def bucket(at: datetime, worker: Worker, *, utilisation: float, tokens: int, queue: int = 0) -> None:
    TelemetrySample.objects.create(
        job=worker.group.job,
        group=worker.group.name,
        worker=worker.name,
        bucket_start=at,
        samples=10,
        utilisation_mean=utilisation,
        utilisation_min=utilisation / 2,
        tokens=tokens,
        queue_length=queue,
    )


def test_telemetry_is_aggregated_per_group_and_bucket(running_job: Job) -> None:
    rollout = list(Worker.objects.filter(group__job=running_job, group__name="rollout").order_by("id"))
    actor = list(Worker.objects.filter(group__job=running_job, group__name="actor").order_by("id"))
    now = datetime(2030, 1, 1, 12, 0, 5, tzinfo=UTC)
    old, previous, current = now - timedelta(hours=2), now - timedelta(seconds=15), now - timedelta(seconds=5)
    bucket(old, rollout[0], utilisation=0.9, tokens=999)
    bucket(previous, rollout[0], utilisation=0.8, tokens=1000, queue=3)
    bucket(previous, rollout[1], utilisation=0.4, tokens=500, queue=2)
    bucket(current, rollout[0], utilisation=0.2, tokens=100)  # 5 s into its 10 s bucket
    bucket(previous, actor[0], utilisation=1.0, tokens=0)

    found = selectors.job_telemetry(running_job, now=now)
    series = {g.group: g for g in found.groups}
    assert set(series) == {"rollout", "actor"} and series["rollout"].kind == "rollout"
    assert found.bucket_s == 10.0 and found.since == now - timedelta(hours=1)

    first, second = series["rollout"].points  # the two-hour-old bucket is outside the default hour
    assert first.at == previous and first.workers == 2
    assert first.utilisation_mean == pytest.approx(0.6)
    assert first.utilisation_min == pytest.approx(0.2)
    assert first.tokens_per_s == pytest.approx(150.0)  # 1500 tokens over 10 s
    assert first.queue_length == 5
    assert second.at == current and second.workers == 1
    assert second.tokens_per_s == pytest.approx(20.0)  # 100 tokens over the 5 s elapsed so far
    (only,) = series["actor"].points
    assert only.utilisation_mean == 1.0 and only.tokens_per_s == 0.0

    newer = selectors.job_telemetry(running_job, since=current, now=now)
    assert [p.at for g in newer.groups for p in g.points] == [current]
    assert {g.group: len(g.points) for g in newer.groups} == {"rollout": 1, "actor": 0}


def test_telemetry_of_another_job_is_not_mixed_in(running_job: Job) -> None:
    make_cluster({"node-c": ("H100", 2)})
    other = mark_running(submit(running_job.owner, spec("other", rollout=1, actor=1)))
    worker = Worker.objects.filter(group__job=other, group__name="rollout").first()
    assert worker is not None
    bucket(timezone.now() - timedelta(seconds=30), worker, utilisation=0.5, tokens=10)
    found = selectors.job_telemetry(running_job)
    assert all(g.points == () for g in found.groups)
    assert [len(g.points) for g in selectors.job_telemetry(other).groups if g.group == "rollout"] == [1]


def test_the_latest_iteration_as_its_driver_measured_it_leaves_a_re_placement_out(running_job: Job) -> None:
    assert selectors.latest_measured_iteration(running_job) is None  # nothing finished yet
    started = running_job.started_at
    assert started is not None

    def result(iteration: int, at_s: float, seconds: dict[str, float] | None) -> None:
        metrics: dict[str, object] = {"tokens_trained": 900 + iteration}
        if seconds is not None:
            metrics["seconds"] = seconds
        IterationResult.objects.create(
            job=running_job,
            iteration=iteration,
            mean_reward=0.5,
            metrics=metrics,
            node="node-a",
            recorded_at=started + timedelta(seconds=at_s),
        )

    phases = {"generate": 2.0, "reward": 0.1, "reference": 0.5, "train": 1.0, "push": 0.2, "verify": 0.1}
    result(0, 6.0, phases)
    first = selectors.latest_measured_iteration(running_job)
    # The first iteration: its phases, not the 6 s since the job started (the workers' setup).
    assert first is not None and first.iteration == 0 and first.duration_s == pytest.approx(3.9)
    assert first.generate_s == 2.0 and first.tokens == 900.0
    assert first.busy_s == {ComponentKind.INFERENCE: 0.5, ComponentKind.ACTOR: 1.2}
    # Iteration 1 ended 50 s later, 44 s of which the job spent being placed anew.
    PlacementChange.objects.create(
        job=running_job,
        iteration=1,
        from_placement="disaggregated",
        to_placement="colocated",
        layout={},
        state=PlacementChangeState.DONE,
        created_at=started + timedelta(seconds=7.0),
        finished_at=started + timedelta(seconds=51.0),
    )
    result(1, 56.0, phases)
    second = selectors.latest_measured_iteration(running_job)
    assert second is not None and (second.iteration, second.duration_s) == (1, 6.0)
    # A result that does not report its phases (not a real runtime's) measures nothing.
    result(2, 62.0, None)
    assert selectors.latest_measured_iteration(running_job) is None
