"""The submit form's helpers, without a browser: where each problem of a spec sits in its text,
and the example specs the form offers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client

from frontend.specmap import error_lines, line_of, path_segments
from frontend.views import example_specs
from jobs.spec import parse_spec
from tests.services import REPO_ROOT

YAML_SPEC = """\
name: x
model: {name: q, params_b: 1.5}
components:
  - name: rollout
    kind: rollout
    workers: 4
  - name: actor
    kind: actor
    parallelism:
      tp: 3
      valid_dp: [1]
    depends_on: [rolout]
policy: {name: dinarl}
"""


def test_path_segments() -> None:
    assert path_segments("components[1].parallelism.tp") == ["components", 1, "parallelism", "tp"]
    assert path_segments("cluster.component_placement.actor") == ["cluster", "component_placement", "actor"]
    assert path_segments("") == []


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("name", 1),
        ("components[1].parallelism.tp", 10),
        ("components[1].parallelism", 9),
        ("components[1].depends_on[0]", 12),
        ("policy.name", 13),
        # A component named in the path instead of indexed.
        ("components.actor.parallelism.tp", 10),
        # A missing key: where it would go, the deepest part of the path that exists.
        ("components[1].hardware", 7),
        ("components[5].workers", 3),
        ("tick_seconds", 1),
    ],
)
def test_line_of_a_yaml_path(path: str, line: int) -> None:
    assert line_of(YAML_SPEC, path) == line


def test_line_of_a_json_path_and_of_an_rlinf_config() -> None:
    colocated = (REPO_ROOT / "examples" / "math-1.5b-colocated.json").read_text()
    lines = colocated.splitlines()
    assert '"tp": 2' in lines[line_of(colocated, "components[2].parallelism.tp") - 1]  # type: ignore[operator]
    assert '"policy"' in lines[line_of(colocated, "policy.name") - 1]  # type: ignore[operator]
    rlinf = (REPO_ROOT / "examples" / "rlinf-hetero.yaml").read_text()
    at = line_of(rlinf, "cluster.component_placement.actor.placement")
    assert at is not None and rlinf.splitlines()[at - 1].strip() == "placement: 0-15"


def test_syntax_errors_use_the_line_their_message_names() -> None:
    broken = "name: x\ncomponents:\n  - name: a\n   kind: rollout\n"
    with pytest.raises(Exception) as caught:
        parse_spec(broken)
    message = caught.value.errors[0].message  # type: ignore[attr-defined]
    [line] = error_lines(broken, [("", message)])
    assert line is not None and 3 <= line <= 4
    assert error_lines(broken, [("name", "x")]) == [None]  # the text does not parse: no position
    assert error_lines("", [("", "the document is empty")]) == [None]


def test_example_specs_are_every_spec_file_and_each_parses() -> None:
    examples = example_specs()
    names = [e["name"] for e in examples]
    on_disk = sorted(
        f"{d}/{p.name}"
        for d in ("examples", "controlplane/demo")
        for p in (REPO_ROOT / d).iterdir()
        if p.suffix in {".yaml", ".yml", ".json"}
    )
    assert sorted(names) == on_disk
    for example in examples:
        assert example["text"] == Path(REPO_ROOT / example["name"]).read_text()
        parse_spec(example["text"])  # every example offered is a valid spec


@pytest.mark.django_db
def test_the_spec_lines_endpoint_needs_a_signed_in_user_and_a_well_formed_body() -> None:
    client = Client(enforce_csrf_checks=False)
    body = {"spec": YAML_SPEC, "problems": [{"path": "policy.name", "message": "unknown"}]}
    anonymous = client.post("/jobs/spec-lines/", json.dumps(body), content_type="application/json")
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]

    user = User.objects.create_user("viewer-lines", password="pw")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    client.force_login(user)
    answer = client.post("/jobs/spec-lines/", json.dumps(body), content_type="application/json")
    assert answer.status_code == 200
    assert answer.json() == {"lines": [13]}
    bad = client.post(
        "/jobs/spec-lines/", json.dumps({"spec": 3, "problems": []}), content_type="application/json"
    )
    assert bad.status_code == 400
    assert client.post("/jobs/spec-lines/", "not json", content_type="application/json").status_code == 400
    assert client.get("/jobs/spec-lines/").status_code == 405
