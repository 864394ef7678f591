"""Submission within bounds: what a hostile operator could post that used to freeze the server,
grow it without end or answer 500 is now a 400 naming the field or the limit (a 413 for the
body's size), with nothing stored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from rest_framework.test import APIClient

from cluster.models import Node
from jobs.models import Job
from tests.api.conftest import error_of, field_paths
from tests.factories import spec
from tests.services import memory_ceiling

pytestmark = pytest.mark.django_db
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GIB = 1024**3
SPEC_MAX_BYTES = 1024 * 1024  # JOB_SPEC_MAX_BYTES's default
JOBS = "/api/v1/jobs/"


def alias_chain() -> str:
    """``a0`` lists ten scalars, each next level ten aliases of the one before: ``a8`` is 10**9."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


def post_text(client: APIClient, text: str, content_type: str = "application/yaml") -> Any:
    return client.post(JOBS, text.encode(), content_type=content_type)


# -- the alias chain (finding 2) ------------------------------------------------------------------------


def test_an_alias_chain_in_a_policy_parameter_is_a_400_naming_the_limit(
    clients: dict[str, APIClient], cluster: list[Node]
) -> None:
    document = yaml.safe_dump(spec("bomb"))
    assert "policy:\n  name: dynarl\n" in document
    document = document.replace(
        "policy:\n  name: dynarl\n", "policy:\n  name: dynarl\n  params:\n    u_low: *a8\n"
    )
    text = alias_chain() + document
    assert len(text) < 1200
    # On the old code the error's repr() of 10**9 values grew the server without end; the ceiling
    # makes that a MemoryError (a 500) here.
    with memory_ceiling(GIB):
        response = post_text(clients["operator"], text)
    assert response.status_code == 400, response.content[:500]
    error = error_of(response)
    assert error["code"] == "invalid_spec" and field_paths(response) == [""]
    assert "more than 20000 values" in error["fields"][0]["message"]
    assert len(response.content) < 1000
    assert not Job.objects.exists()


def test_an_alias_chain_in_an_rlinf_configs_policy_params_is_a_400(clients: dict[str, APIClient]) -> None:
    text = (
        alias_chain()
        + (EXAMPLES / "rlinf-disaggregated.yaml").read_text()
        + "\ndynarl:\n  policy: dynarl\n  policy_params:\n    u_low: *a8\n"
    )
    with memory_ceiling(GIB):
        response = post_text(clients["operator"], text)
    assert response.status_code == 400
    assert "more than 20000 values" in error_of(response)["fields"][0]["message"]


# -- work bounded before it is done (finding 3) -----------------------------------------------------------


def test_a_placement_of_ten_million_ranks_is_a_400_before_it_is_expanded(
    clients: dict[str, APIClient], cluster: list[Node]
) -> None:
    data = spec("range")
    data["components"][0] = {"name": "rollout", "kind": "rollout", "placement": "0-9999999"}
    with memory_ceiling(GIB // 2):  # expanded, the old list took 730 MB (and then a 422)
        response = clients["operator"].post(JOBS, data, format="json")
    assert response.status_code == 400
    assert field_paths(response) == ["components[0].placement"]
    assert "the highest a spec may name" in error_of(response)["message"]


def _padded(content_type: str, size: int) -> str:
    """A valid spec of exactly ``size`` bytes in the given form."""
    if content_type == "wrapped":
        inner = yaml.safe_dump(spec("padded")) + "#"
        body = json.dumps({"spec": inner})
        return json.dumps({"spec": inner + "x" * (size - len(body))})
    if content_type == "application/json":
        text = json.dumps(spec("padded"))
        return text + " " * (size - len(text))
    text = yaml.safe_dump(spec("padded")) + "#"
    return text + "x" * (size - len(text))


@pytest.mark.parametrize(
    "content_type", ["application/json", "wrapped", "application/yaml", "text/yaml", "application/x-yaml"]
)
def test_one_body_limit_for_yaml_and_json_answered_413_naming_it(
    clients: dict[str, APIClient], cluster: list[Node], content_type: str
) -> None:
    wire_type = "application/json" if content_type == "wrapped" else content_type
    over = _padded(content_type, SPEC_MAX_BYTES + 1)
    assert len(over.encode()) == SPEC_MAX_BYTES + 1
    response = post_text(clients["operator"], over, wire_type)
    assert response.status_code == 413, response.content[:300]
    error = error_of(response)
    assert error["code"] == "payload_too_large"
    assert f"at most {SPEC_MAX_BYTES} bytes (JOB_SPEC_MAX_BYTES)" in error["message"]
    assert not Job.objects.exists()

    at_limit = _padded(content_type, SPEC_MAX_BYTES)
    accepted = post_text(clients["operator"], at_limit, wire_type)
    assert accepted.status_code == 201, accepted.content[:300]


def test_a_5_mb_json_body_is_a_413_not_a_500(clients: dict[str, APIClient], cluster: list[Node]) -> None:
    text = json.dumps(spec("big")) + " " * (5 * 1024 * 1024)
    response = post_text(clients["operator"], text, "application/json")
    assert response.status_code == 413
    assert error_of(response)["code"] == "payload_too_large"


def test_a_50_mb_yaml_body_is_refused_and_not_stored(
    clients: dict[str, APIClient], cluster: list[Node], settings: Any
) -> None:
    settings.JOB_SPEC_MAX_BYTES = 4096  # the limit is a setting; a small one keeps the test light
    text = yaml.safe_dump(spec("huge-yaml")) + "# " + "x" * 8192 + "\n"
    response = post_text(clients["operator"], text)
    assert response.status_code == 413
    assert "at most 4096 bytes (JOB_SPEC_MAX_BYTES)" in error_of(response)["message"]
    assert not Job.objects.exists()


def test_other_endpoints_over_djangos_body_limit_are_413_not_500(
    clients: dict[str, APIClient], running_job: Job
) -> None:
    body = json.dumps({"detail": "x" * (3 * 1024 * 1024)})
    response = clients["operator"].post(
        f"{JOBS}{running_job.pk}/pause/", body.encode(), content_type="application/json"
    )
    assert response.status_code == 413
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in error_of(response)["message"]


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_deep_nesting_is_a_400_not_a_500(
    clients: dict[str, APIClient], cluster: list[Node], depth: int
) -> None:
    nested = "[" * depth + "]" * depth
    as_json = json.dumps(spec("deep"))[:-1] + f', "tick_seconds": {nested}}}'
    as_yaml = yaml.safe_dump(spec("deep")) + f"tick_seconds: {nested}\n"
    for text, content_type in ((as_json, "application/json"), (as_yaml, "application/yaml")):
        response = post_text(clients["operator"], text, content_type)
        assert response.status_code == 400, (content_type, response.content[:300])
        assert field_paths(response) == [""]
        assert "deeper than 64 levels" in error_of(response)["message"]
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda d: d["workload"].update(iterations=2**64), "workload.iterations"),
        (lambda d: d["components"][0].update(max_workers=2**63), "components[0].max_workers"),
    ],
)
def test_integers_the_database_cannot_store_are_a_400_naming_the_field(
    clients: dict[str, APIClient], cluster: list[Node], edit: Any, path: str
) -> None:
    data = spec("ints")
    edit(data)
    response = clients["operator"].post(JOBS, data, format="json")
    assert response.status_code == 400, response.content[:300]
    assert field_paths(response) == [path]
    assert "must be at most 2147483647" in error_of(response)["message"]
    assert not Job.objects.exists()


def test_a_key_written_twice_in_a_json_body_is_refused_as_in_yaml(
    clients: dict[str, APIClient], cluster: list[Node]
) -> None:
    text = json.dumps(spec("first"))[:-1] + ', "name": "second"}'
    response = post_text(clients["operator"], text, "application/json")
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_spec"
    assert error_of(response)["fields"] == [{"path": "", "message": "JSON object has a duplicate key 'name'"}]
    assert not Job.objects.exists()


# -- trace paths (finding 9) ------------------------------------------------------------------------------


@pytest.mark.parametrize("trace", ["../../../../etc/shadow", "/etc/shadow", "traces/\x00.jsonl"])
def test_a_trace_path_that_could_leave_the_trace_directory_is_a_400(
    clients: dict[str, APIClient], cluster: list[Node], trace: str
) -> None:
    data = spec("trace")
    data["workload"]["trace"] = trace
    response = clients["operator"].post(JOBS, data, format="json")
    assert response.status_code == 400
    assert field_paths(response) == ["workload.trace"]
    assert not Job.objects.exists()
