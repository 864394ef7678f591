"""The command long-poll through a real ASGI server (daphne): it returns as soon as a command is
queued, and many waiting agents do not stop heartbeats from being served."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings

from agents.services import delivery
from cluster.models import AgentCommand, Node
from common.models import AuditEvent
from tests.agents.conftest import register
from tests.services import REPO_ROOT, free_port, stop_process_tree, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def server(service_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    port = free_port()
    # No database fallback within the test: only the Redis wake-up can end a poll early.
    env = {**service_env, "AGENT_POLL_FALLBACK_S": "60"}
    log = open(tmp_path / "daphne.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"],
        cwd=REPO_ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            urllib.request.urlopen(f"{url}/api/v1/agent/commands", timeout=1)
        except urllib.error.HTTPError:
            return True  # 401: the server answers
        except OSError:
            return False
        return True

    try:
        assert wait_until(up, timeout_s=30), (tmp_path / "daphne.log").read_text()
        yield url
    finally:
        stop_process_tree(proc)
        log.close()
    # The polls waited on Redis the whole time; they never fell back to polling the database.
    assert "Redis unavailable" not in (tmp_path / "daphne.log").read_text()


def call(
    url: str, token: str, *, method: str = "GET", body: Any = None, timeout: float = 20, request_id: str = ""
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            **({"X-Request-ID": request_id} if request_id else {}),
        },
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, json.loads(response.read())


def wake_subscribers() -> int:
    return int(redis.Redis.from_url(settings.REDIS_URL).pubsub_numsub(delivery.WAKE_CHANNEL)[0][1])


def test_long_poll_returns_as_soon_as_a_command_is_queued(client: Any, bootstrap: str, server: str) -> None:
    agent, _ = register(client, bootstrap, "node-a", gpus=2)
    node = Node.objects.get(name="node-a")
    answers: list[tuple[int, Any]] = []
    # The poll may wait 50 s, but the client gives up after 20: only an early return passes.
    poll = threading.Thread(
        target=lambda: answers.append(
            call(f"{server}/api/v1/agent/commands?wait=50", agent.token, timeout=20, request_id="poll-1")
        )
    )
    poll.start()
    # The server subscribes to wake-ups when its first poll finds nothing to deliver; give that
    # poll a moment to recheck the database and start waiting.
    assert wait_until(lambda: wake_subscribers() >= 1, timeout_s=15), "the poll never started waiting"
    time.sleep(0.5)

    AgentCommand.objects.create(command_id="cmd-1", node=node, kind="noop", payload={"x": 1})
    poll.join(timeout=25)

    assert answers, "the long-poll did not return early"
    status, body = answers[0]
    assert status == 200 and [c["command_id"] for c in body["commands"]] == ["cmd-1"]
    assert AgentCommand.objects.get(command_id="cmd-1").deliveries == 1
    # The delivery ran on the server's database threads, and its audit row still has the request id.
    assert AuditEvent.objects.get(verb="agent.command.deliver").request_id == "poll-1"


def test_waiting_polls_do_not_block_other_requests(client: Any, bootstrap: str, server: str) -> None:
    agents = [register(client, bootstrap, f"node-{i}", gpus=1)[0] for i in range(24)]
    answers: list[tuple[int, Any]] = []
    polls = [
        threading.Thread(
            target=lambda token=a.token: answers.append(
                call(f"{server}/api/v1/agent/commands?wait=30", token, timeout=40)
            )
        )
        for a in agents
    ]
    for poll in polls:
        poll.start()
    assert wait_until(lambda: wake_subscribers() >= 1, timeout_s=20), "the server never subscribed"

    status, beat = call(
        f"{server}/api/v1/agent/heartbeat", agents[0].token, method="POST", body={"sent_at": 1.0}
    )
    assert status == 200 and beat["node_status"] == "ready"
    assert not answers  # every poll was still waiting while the heartbeat was served

    for i, a in enumerate(agents):
        AgentCommand.objects.create(command_id=f"wake-{i}", node=Node.objects.get(name=a.host), kind="noop")
    for poll in polls:
        poll.join(timeout=35)
    assert sorted(c["command_id"] for _, body in answers for c in body["commands"]) == sorted(
        f"wake-{i}" for i in range(len(agents))
    )
