"""The ``dynarl`` CLI end to end, against a live server with real tokens."""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from cli.main import EXIT_API_ERROR, EXIT_OK, EXIT_USAGE, main
from cluster.models import Device, Node
from common.models import ApiToken
from jobs.models import Job
from scheduler.models import Migration, Tick
from tests.services import free_port

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = """name: math-small
model: {name: qwen2.5-1.5b, params_b: 1.5}
workload: {kind: math, iterations: 3, prompts_per_iteration: 64, samples_per_prompt: 4}
components:
  - {name: rollout, kind: rollout, workers: 4}
  - {name: actor, kind: actor, workers: 2, depends_on: [rollout]}
policy: {name: dynarl}
"""
BAD_SPEC = SPEC.replace(
    "{name: rollout, kind: rollout, workers: 4}",
    "{name: rollout, kind: rollout, workers: 4, parallelism: {tp: 0}}",
)


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture(autouse=True)
def plain_static_files(settings: Any) -> None:
    """The login page links static files; tests run without collectstatic's manifest."""
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }


@pytest.fixture(autouse=True)
def isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No developer config or environment leaks into the tests."""
    path = tmp_path / "config" / "dynarl.json"
    monkeypatch.setenv("DYNARL_CONFIG", str(path))
    monkeypatch.delenv("DYNARL_URL", raising=False)
    monkeypatch.delenv("DYNARL_TOKEN", raising=False)
    return path


def user(username: str, role: str, *, staff: bool = False) -> User:
    account = User.objects.create_user(username=username, password=f"secret-{username}-pw", is_staff=staff)
    account.groups.add(Group.objects.get_or_create(name=role)[0])
    return account


@pytest.fixture
def cluster() -> Node:
    node = Node.objects.create(name="gpu-node-1", last_heartbeat_at=timezone.now())
    for index in range(8):
        Device.objects.create(node=node, index=index, uid=f"gpu-node-1/gpu{index}", hardware="H100")
    return node


@pytest.fixture
def operator_token() -> str:
    return ApiToken.issue(user("olivia", "operator"), "test")[1]


@pytest.fixture
def dynarl(live_server: Any, operator_token: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Run the CLI in-process as the operator: ``dynarl("jobs", stdin=...)``."""

    def run(
        *argv: str, token: str | None = operator_token, stdin: str = "", url: str | None = None
    ) -> Result:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
        out, err = io.StringIO(), io.StringIO()
        flags = ["--url", url or live_server.url] + (["--token", token] if token else [])
        code = main([*flags, *argv], out=out, err=err)
        return Result(code, out.getvalue(), err.getvalue())

    yield run


def submit(dynarl: Any, tmp_path: Path, *extra: str, text: str = SPEC, name: str = "spec.yaml") -> Result:
    spec = tmp_path / name
    spec.write_text(text)
    return dynarl("submit", str(spec), *extra)


def test_submit_list_show_and_cancel(dynarl: Any, cluster: Node, tmp_path: Path) -> None:
    submitted = submit(dynarl, tmp_path, "--idempotency-key", "run-1")
    assert submitted.code == EXIT_OK, submitted.err
    job = Job.objects.get()
    assert submitted.out.startswith(f"job {job.pk} math-small: admitted")
    assert job.owner.username == "olivia"

    again = submit(dynarl, tmp_path, "--idempotency-key", "run-1")
    assert again.code == EXIT_OK
    assert "already submitted" in again.out
    assert Job.objects.count() == 1

    listed = dynarl("jobs")
    assert listed.code == EXIT_OK
    header, row = listed.out.splitlines()[:2]
    assert header.split()[:4] == ["ID", "NAME", "OWNER", "STATE"]
    assert row.split()[:4] == [str(job.pk), "math-small", "olivia", "admitted"]

    Tick.objects.create(job=job, outcome="no_change", note="no group is idle enough to lend its GPUs")
    shown = dynarl("job", str(job.pk))
    assert shown.code == EXIT_OK
    assert "state      admitted (admitted)" in shown.out
    # The scheduler's last word on it, and why it moved nothing.
    [last_tick] = [line for line in shown.out.splitlines() if line.strip().startswith("last tick")]
    assert last_tick.strip().startswith("last tick  no_change at ")
    assert last_tick.endswith(": no group is idle enough to lend its GPUs")
    assert "6 allocated of 6 asked" in shown.out
    assert any(line.split()[:3] == ["rollout", "rollout", "4"] for line in shown.out.splitlines())

    cancelled = dynarl("cancel", str(job.pk), "--reason", "wrong model")
    assert cancelled.code == EXIT_OK
    assert cancelled.out.strip() == f"job {job.pk} math-small: cancelled (cancelled_by_operator)"
    job.refresh_from_db()
    assert (job.state, job.state_detail) == ("cancelled", "wrong model")

    as_json = dynarl("--json", "jobs", "--state", "cancelled")
    assert [j["id"] for j in as_json.json()] == [job.pk]
    assert dynarl("jobs", "--state", "running,pending", "--json").json() == []


def test_json_and_rlinf_specs_are_accepted(dynarl: Any, cluster: Node, tmp_path: Path) -> None:
    import yaml

    as_json = submit(dynarl, tmp_path, "--json", text=json.dumps(yaml.safe_load(SPEC)), name="spec.json")
    assert as_json.code == EXIT_OK, as_json.err
    assert as_json.json()["spec_format"] == "dynarl"
    rlinf_example = Path(__file__).resolve().parents[2] / "examples" / "rlinf-colocated.yaml"
    rlinf = dynarl("--json", "submit", str(rlinf_example))
    assert rlinf.code == EXIT_OK, rlinf.err
    assert rlinf.json()["spec_format"] == "rlinf"


def test_a_bad_spec_prints_the_field_path_and_exits_1(dynarl: Any, cluster: Node, tmp_path: Path) -> None:
    result = submit(dynarl, tmp_path, text=BAD_SPEC)
    assert result.code == EXIT_API_ERROR
    assert result.err.startswith("error: invalid job spec")
    assert "components[0].parallelism.tp: must be at least 1, got 0" in result.err
    assert "request id" in result.err
    assert not Job.objects.exists()

    as_json = submit(dynarl, tmp_path, "--json", text=BAD_SPEC)
    error = json.loads(as_json.err)["error"]
    assert (error["status"], error["code"]) == (400, "invalid_spec")
    assert error["fields"] == [
        {"path": "components[0].parallelism.tp", "message": "must be at least 1, got 0"}
    ]


def test_a_viewer_cannot_cancel(dynarl: Any, cluster: Node, tmp_path: Path) -> None:
    assert submit(dynarl, tmp_path).code == EXIT_OK
    job = Job.objects.get()
    viewer_token = ApiToken.issue(user("vera", "viewer"), "test")[1]
    assert dynarl("job", str(job.pk), token=viewer_token).code == EXIT_OK
    refused = dynarl("cancel", str(job.pk), token=viewer_token)
    assert refused.code == EXIT_API_ERROR
    assert "operator role" in refused.err
    job.refresh_from_db()
    assert job.state != "cancelled"


def test_migrations_and_exports_as_csv_and_json(dynarl: Any, cluster: Node, tmp_path: Path) -> None:
    assert submit(dynarl, tmp_path).code == EXIT_OK
    job = Job.objects.get()
    Migration.objects.create(
        migration_id="mig-1",
        job=job,
        donor="rollout",
        recipient="actor",
        strategy="workload+p2p",
        device_uids=["gpu-node-1/gpu0", "gpu-node-1/gpu1"],
        state="committed",
        plan={},
    )

    listed = dynarl("migrations", "--job", str(job.pk))
    assert listed.code == EXIT_OK
    assert listed.out.splitlines()[1].split()[:6] == [
        "mig-1",
        str(job.pk),
        "committed",
        "workload+p2p",
        "rollout",
        "->",
    ]

    as_csv = dynarl("migrations", "--job", str(job.pk), "--csv")
    assert as_csv.code == EXIT_OK
    rows = list(csv.DictReader(io.StringIO(as_csv.out)))
    assert [(r["migration_id"], r["state"], r["device_uids"]) for r in rows] == [
        ("mig-1", "committed", "gpu-node-1/gpu0 gpu-node-1/gpu1")
    ]
    assert dynarl("migrations", "--job", str(job.pk + 1000), "--csv").out.count("\n") == 1  # header only

    exported = dynarl("export", "migrations", "--format", "csv", "--job", str(job.pk))
    assert [r["migration_id"] for r in csv.DictReader(io.StringIO(exported.out))] == ["mig-1"]

    target = tmp_path / "audit.json"
    written = dynarl("export", "audit", "--format", "json", "-o", str(target))
    assert written.code == EXIT_OK
    assert f"to {target}" in written.err
    verbs = {event["verb"] for event in json.loads(target.read_text())}
    assert "job.submit" in verbs

    audit_csv = dynarl("export", "audit")
    assert "job.submit" in {r["verb"] for r in csv.DictReader(io.StringIO(audit_csv.out))}


def test_nodes_table(dynarl: Any, cluster: Node) -> None:
    result = dynarl("nodes")
    assert result.code == EXIT_OK
    header, row = result.out.splitlines()
    assert header.split()[:5] == ["NAME", "STATUS", "BACKEND", "HARDWARE", "GPUS"]
    assert row.split()[:8] == ["gpu-node-1", "ready", "sim", "H100", "8", "8", "0", "0"]
    assert dynarl("nodes", "--status", "lost").out.strip() == "no nodes"


def test_login_with_a_password_saves_a_token_that_later_commands_use(
    dynarl: Any, live_server: Any, cluster: Node, isolated_config: Path
) -> None:
    user("sam", "operator")  # not staff: the dashboard's login page admits every user
    refused = dynarl("login", "--username", "sam", "--password-stdin", token=None, stdin="wrong\n")
    assert refused.code == EXIT_API_ERROR
    assert "refused the username or password" in refused.err
    assert not isolated_config.exists()

    result = dynarl("login", "--username", "sam", "--password-stdin", token=None, stdin="secret-sam-pw\n")
    assert result.code == EXIT_OK, result.err
    assert f"as sam (operator); token saved in {isolated_config}" in result.out
    saved = json.loads(isolated_config.read_text())
    assert saved["url"] == live_server.url
    assert stat.S_IMODE(os.stat(isolated_config).st_mode) == 0o600
    assert ApiToken.objects.filter(user__username="sam", key_prefix=saved["token"][:12]).exists()

    # No --token, no environment: the saved one is used ...
    assert dynarl("nodes", "--json", token=None).json()[0]["name"] == "gpu-node-1"
    # ... but never sent to another server.
    elsewhere = dynarl("nodes", token=None, url="http://127.0.0.1:9")
    assert elsewhere.code == EXIT_USAGE
    assert "no API token for http://127.0.0.1:9" in elsewhere.err


def test_login_with_a_token_from_stdin(dynarl: Any, operator_token: str, isolated_config: Path) -> None:
    bad = dynarl("login", "--with-token", token=None, stdin="dynarl_not-a-token\n")
    assert bad.code == EXIT_API_ERROR
    assert "invalid token" in bad.err
    good = dynarl("login", "--with-token", token=None, stdin=operator_token + "\n")
    assert good.code == EXIT_OK, good.err
    assert json.loads(isolated_config.read_text())["token"] == operator_token


def test_usage_errors_exit_2(dynarl: Any, tmp_path: Path) -> None:
    no_token = dynarl("jobs", token=None)
    assert no_token.code == EXIT_USAGE
    assert "run 'dynarl login'" in no_token.err
    missing = dynarl("submit", str(tmp_path / "nope.yaml"))
    assert missing.code == EXIT_USAGE
    assert "cannot read" in missing.err
    with pytest.raises(SystemExit) as bad_state:
        dynarl("jobs", "--state", "sleeping")
    assert bad_state.value.code == EXIT_USAGE
    with pytest.raises(SystemExit) as no_command:
        dynarl()
    assert no_command.value.code == EXIT_USAGE


def test_an_unreachable_server_exits_1(dynarl: Any) -> None:
    result = dynarl("jobs", url=f"http://127.0.0.1:{free_port()}")
    assert result.code == EXIT_API_ERROR
    assert result.err.startswith("error: cannot reach http://127.0.0.1:")


def test_the_installed_console_script(live_server: Any, operator_token: str, cluster: Node) -> None:
    script = Path(sys.executable).with_name("dynarl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNARL_")}
    env["DYNARL_URL"], env["DYNARL_TOKEN"] = live_server.url, operator_token
    done = subprocess.run(
        [str(script), "--json", "nodes"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert [n["name"] for n in json.loads(done.stdout)] == ["gpu-node-1"]
    bad = subprocess.run(
        [str(script), "jobs", "--limit"], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == EXIT_USAGE
