"""Rows the live-event, metrics and alert tests build on."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from cluster.models import Device, DeviceStatus, Node
from jobs.models import Job, JobState, Worker, WorkerGroup, WorkerState
from scheduler.models import TelemetrySample


def make_user(username: str, role: str | None = "viewer", *, superuser: bool = False) -> User:
    user = User.objects.create_user(username=username, password="pw-" + username, is_superuser=superuser)
    if role is not None:
        user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


def make_job(owner: User, name: str = "job", state: str = JobState.RUNNING, **fields: Any) -> Job:
    return Job.objects.create(owner=owner, name=name, spec={}, policy="dynarl", state=state, **fields)


def make_group(job: Job, name: str, kind: str) -> WorkerGroup:
    scaling = "static" if kind == "actor" else "dynamic"
    return WorkerGroup.objects.create(job=job, name=name, kind=kind, scaling=scaling, interruptibility="any")


def make_worker(group: WorkerGroup, name: str, *, started_ago_s: float = 3600, **fields: Any) -> Worker:
    now = timezone.now()
    fields.setdefault("state", WorkerState.RUNNING)
    return Worker.objects.create(
        group=group,
        name=name,
        created_at=now - timedelta(seconds=started_ago_s),
        started_at=now - timedelta(seconds=started_ago_s),
        **fields,
    )


def make_node(
    name: str, *, heartbeat_ago_s: float | None = 0.0, gpus: int = 0, hardware: str = "H100"
) -> Node:
    now = timezone.now()
    node = Node.objects.create(
        name=name,
        registered_at=now - timedelta(hours=1),
        last_heartbeat_at=None if heartbeat_ago_s is None else now - timedelta(seconds=heartbeat_ago_s),
    )
    for index in range(gpus):
        Device.objects.create(node=node, index=index, uid=f"{name}/gpu{index}", hardware=hardware)
    return node


def allocate(device: Device, worker: Worker) -> None:
    device.worker = worker
    device.status = DeviceStatus.ALLOCATED
    device.save(update_fields=["worker", "status"])


def aligned(at: datetime, bucket_s: float = 10) -> datetime:
    """The start of the telemetry bucket holding ``at`` (ingest aligns buckets the same way)."""
    epoch = at.timestamp()
    return datetime.fromtimestamp(epoch - epoch % bucket_s, tz=UTC)


def mid_bucket(at: datetime | None = None, bucket_s: float = 10) -> datetime:
    """An instant half-way through a bucket, so window edges never fall on a bucket start."""
    return aligned(at or timezone.now(), bucket_s) + timedelta(seconds=bucket_s / 2)


@pytest.fixture
def telemetry() -> Callable[..., None]:
    """Write (or overwrite) one worker's downsampled telemetry: one row per aligned 10 s bucket,
    from the bucket holding ``now - until_ago_s`` back over ``span_s``."""

    def write(
        worker: Worker,
        *,
        utilisation: float,
        tokens: int = 0,
        span_s: float = 120,
        until_ago_s: float = 0,
        bucket_s: float = 10,
        now: datetime | None = None,
    ) -> None:
        last = aligned((now or timezone.now()) - timedelta(seconds=until_ago_s), bucket_s)
        group = worker.group
        for k in range(int(span_s // bucket_s)):
            TelemetrySample.objects.update_or_create(
                worker=worker.name,
                bucket_start=last - timedelta(seconds=k * bucket_s),
                defaults={
                    "job_id": group.job_id,
                    "group": group.name,
                    "samples": int(bucket_s),
                    "utilisation_mean": utilisation,
                    "utilisation_min": utilisation,
                    "tokens": tokens,
                },
            )

    return write


@pytest.fixture
def user_factory() -> Callable[..., User]:
    return make_user
