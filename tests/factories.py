"""Building blocks for tests: a cluster of nodes and devices, users with roles, running jobs."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Group, User
from django.db import transaction
from django.utils import timezone

from cluster.models import Device, Node
from common.audit import Actor
from jobs import services
from jobs.models import Job, JobReason, JobState, Worker, WorkerState
from jobs.states import transition


def make_cluster(nodes: dict[str, tuple[str, int]]) -> list[Node]:
    """{"node-a": ("H100", 8), ...} -> registered, ready nodes with their devices."""
    made = []
    for name, (hardware, count) in nodes.items():
        node = Node.objects.create(name=name, last_heartbeat_at=timezone.now())
        Device.objects.bulk_create(
            Device(node=node, index=i, uid=f"{name}/gpu{i}", hardware=hardware) for i in range(count)
        )
        made.append(node)
    return made


def make_user(username: str, role: str | None = "operator") -> User:
    user = User.objects.create_user(username=username, password="pw-" + username)
    if role == "admin":
        user.is_superuser = user.is_staff = True
        user.save()
    elif role is not None:
        group, _ = Group.objects.get_or_create(name=role)
        user.groups.add(group)
    return user


def spec(
    name: str = "math-small", *, rollout: int = 4, actor: int = 2, policy: str = "dynarl", **extra: Any
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": name,
        "model": {"name": "qwen2.5-1.5b", "params_b": 1.5},
        "workload": {"kind": "math", "iterations": 3, "prompts_per_iteration": 64, "samples_per_prompt": 4},
        "components": [
            {"name": "rollout", "kind": "rollout", "workers": rollout},
            {"name": "actor", "kind": "actor", "workers": actor, "depends_on": ["rollout"]},
        ],
        "policy": {"name": policy},
    }
    data.update(extra)
    return data


def ray_spec(name: str = "math-real", *, rollout: int = 1, actor: int = 2, **extra: Any) -> dict[str, Any]:
    """A job the ray runtime can run (``spec`` plus what its rules ask: a reward component, and
    responses that fit the runtime's model)."""
    data = spec(name, rollout=rollout, actor=actor, backend="ray", **extra)
    data["workload"]["max_new_tokens"] = 40
    data["components"].append({"name": "reward", "kind": "reward", "workers": 1})
    return data


def submit(owner: User, data: dict[str, Any] | None = None, **kwargs: Any) -> Job:
    return services.submit_job(owner=owner, source=data or spec(), actor=Actor.for_user(owner), **kwargs).job


def mark_running(job: Job) -> Job:
    """What the agents' launch reports do: every worker runs, the job runs."""
    Worker.objects.filter(group__job=job).update(state=WorkerState.RUNNING, started_at=timezone.now())
    with transaction.atomic():
        locked = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
        transition(locked, JobState.RUNNING, JobReason.WORKERS_LAUNCHED, Actor.system("test agents"))
    job.refresh_from_db()
    return job
