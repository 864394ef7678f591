"""Command delivery: queued commands go out once, unanswered ones again after a timeout."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from pytest_django.fixtures import Settings

from cluster.models import AgentCommand, CommandState
from common.audit import Actor
from common.models import AuditEvent
from jobs import services as job_services
from jobs.models import Worker, WorkerState
from tests.agents.conftest import register
from tests.factories import make_user, spec, submit
from tests.services import REPO_ROOT

pytestmark = pytest.mark.django_db


def test_queued_commands_are_delivered_once(client: Client, bootstrap: str) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=4)
    assert agent.fetch().json() == {"commands": []}
    job = submit(make_user("alice"), spec(rollout=2, actor=2))
    launch = AgentCommand.objects.get(kind="launch_workers")

    response = agent.fetch()
    assert response.status_code == 200 and response["X-Dynarl-Agent-Protocol"] == "1"
    [command] = response.json()["commands"]
    assert command["command_id"] == launch.command_id and command["kind"] == "launch_workers"
    assert command["deliveries"] == 1
    assert {w["worker"] for w in command["payload"]["workers"]} == set(
        Worker.objects.filter(group__job=job).values_list("name", flat=True)
    )
    launch.refresh_from_db()
    assert launch.state == CommandState.DELIVERED and launch.deliveries == 1 and launch.delivered_at
    assert agent.fetch().json() == {"commands": []}
    assert AuditEvent.objects.filter(verb="agent.command.deliver", actor="agent:node-a", job=job).count() == 1


def test_unanswered_commands_are_delivered_again(client: Client, bootstrap: str, settings: Settings) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=4)
    submit(make_user("alice"), spec(rollout=2, actor=2))
    assert len(agent.fetch().json()["commands"]) == 1
    settings.AGENT_COMMAND_REDELIVER_S = 0.0
    [again] = agent.fetch().json()["commands"]
    assert again["deliveries"] == 2
    assert AuditEvent.objects.filter(verb="agent.command.redeliver").count() == 1


def test_commands_no_longer_needed_are_cancelled_not_delivered(client: Client, bootstrap: str) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=4)
    job = submit(make_user("alice"), spec(rollout=2, actor=2))
    launch = AgentCommand.objects.get(kind="launch_workers")
    # The workers were stopped some other way before the agent asked.
    Worker.objects.filter(group__job=job).update(state=WorkerState.STOPPING)
    assert agent.fetch().json() == {"commands": []}
    launch.refresh_from_db()
    assert launch.state == CommandState.CANCELLED and "none of its workers" in launch.result["cancelled"]


def test_a_node_only_gets_its_own_commands(client: Client, bootstrap: str) -> None:
    a, _ = register(client, bootstrap, "node-a", gpus=4)
    b, _ = register(client, bootstrap, "node-b", gpus=4)
    submit(make_user("alice"), spec(rollout=2, actor=2))  # fits on node-a alone
    node_of_launch = AgentCommand.objects.get(kind="launch_workers").node.name
    mine, theirs = (a, b) if node_of_launch == "node-a" else (b, a)
    assert theirs.fetch().json() == {"commands": []}
    assert len(mine.fetch().json()["commands"]) == 1


@pytest.mark.parametrize("wait", ["-1", "61", "soon", "nan"])
def test_bad_wait_is_refused(client: Client, bootstrap: str, wait: str) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=1)
    response = agent.fetch(wait)
    assert response.status_code == 400
    assert response.json()["error"]["fields"][0]["path"] == "wait"


def test_cancelled_job_commands_are_not_delivered(client: Client, bootstrap: str) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=4)
    owner = make_user("alice")
    job = submit(owner, spec(rollout=2, actor=2))
    job_services.cancel_job(job.pk, Actor.for_user(owner))
    assert agent.fetch().json() == {"commands": []}


def test_stopping_a_colocated_job_stops_the_workers_that_own_no_device(
    client: Client, bootstrap: str
) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=8)
    owner = make_user("alice")
    colocated = json.loads((REPO_ROOT / "examples" / "math-1.5b-colocated.json").read_text())
    job = submit(owner, colocated)
    agent.fetch()  # the launch is delivered: the workers run on the agent
    # Rollout, reward and actor time-share GPUs 0-7; the devices' owners are of one group only.
    assert Worker.objects.filter(group__job=job, devices__isnull=True).exists()
    job_services.cancel_job(job.pk, Actor.for_user(owner))
    [stop] = AgentCommand.objects.filter(kind="stop_workers")
    assert sorted(stop.payload["workers"]) == sorted(
        Worker.objects.filter(group__job=job).values_list("name", flat=True)
    )
