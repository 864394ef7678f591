"""One error shape for every 4xx/5xx, with the request id in the body and the header."""

from __future__ import annotations

import logging

import pytest
from rest_framework.test import APIClient

from common.api.errors import flatten_detail
from jobs.models import Job
from tests.api.conftest import error_of, field_paths

pytestmark = pytest.mark.django_db


def test_unknown_api_urls_answer_json_404(clients: dict[str, APIClient]) -> None:
    for method in ("get", "post", "delete"):
        response = getattr(clients["viewer"], method)("/api/v1/no-such-thing/")
        assert response.status_code == 404
        assert response["Content-Type"] == "application/json"
        error = error_of(response)
        assert error["code"] == "not_found"
        assert "/api/v1/no-such-thing/" in error["message"]
    # Even without credentials, and without the trailing slash (with a hint).
    response = clients["anonymous"].get("/api/v1/jobs")
    assert response.status_code == 404
    assert "did you mean /api/v1/jobs/" in error_of(response)["message"]


def test_a_missing_object_is_404(clients: dict[str, APIClient]) -> None:
    response = clients["viewer"].get("/api/v1/jobs/999999/")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def test_the_callers_request_id_comes_back_in_header_and_body(clients: dict[str, APIClient]) -> None:
    response = clients["viewer"].get("/api/v1/jobs/424242/", HTTP_X_REQUEST_ID="trace-abc-123")
    assert response["X-Request-ID"] == "trace-abc-123"
    assert error_of(response)["request_id"] == "trace-abc-123"


def test_method_not_allowed_is_405(clients: dict[str, APIClient], running_job: Job) -> None:
    response = clients["admin"].delete(f"/api/v1/jobs/{running_job.pk}/")
    assert response.status_code == 405
    assert error_of(response)["code"] == "method_not_allowed"
    assert Job.objects.filter(pk=running_job.pk).exists()


def test_unsupported_body_type_is_415(clients: dict[str, APIClient]) -> None:
    response = clients["operator"].post("/api/v1/jobs/", {"name": "x"})  # form-encoded
    assert response.status_code == 415
    assert error_of(response)["code"] == "unsupported_media_type"


def test_malformed_json_is_400(clients: dict[str, APIClient]) -> None:
    response = clients["operator"].post("/api/v1/jobs/", "{not json", content_type="application/json")
    assert response.status_code == 400
    assert error_of(response)["code"] == "parse_error"


def test_invalid_filters_are_400_naming_the_parameter(clients: dict[str, APIClient]) -> None:
    response = clients["viewer"].get("/api/v1/jobs/", {"submitted_after": "yesterday-ish", "state": "bogus"})
    assert response.status_code == 400
    assert sorted(field_paths(response)) == ["state", "submitted_after"]
    assert error_of(response)["code"] == "invalid"
    fractional = clients["viewer"].get("/api/v1/migrations/", {"job": "1.5"})
    assert fractional.status_code == 400
    assert field_paths(fractional) == ["job"]


def test_nested_validation_details_become_key_paths() -> None:
    detail = {
        "components": [{}, {"parallelism": {"tp": ["must be at least 1"]}}],
        "tags": {"0": ["not a string"]},
        "non_field_errors": ["inconsistent"],
    }
    assert [(p.path, p.message) for p in flatten_detail(detail)] == [
        ("components[1].parallelism.tp", "must be at least 1"),
        ("tags[0]", "not a string"),
        ("", "inconsistent"),
    ]


def test_a_page_past_the_end_is_404(clients: dict[str, APIClient]) -> None:
    response = clients["viewer"].get("/api/v1/jobs/", {"page": 99})
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def test_an_illegal_transition_is_409_naming_both_states(
    clients: dict[str, APIClient], running_job: Job
) -> None:
    response = clients["operator"].post(f"/api/v1/jobs/{running_job.pk}/resume/", {}, format="json")
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "illegal_transition"
    assert error["message"] == "job cannot go from 'running' to 'running'"
    assert error["fields"] == [
        {"path": "state", "message": "the current state is 'running'; it cannot become 'running'"}
    ]


@pytest.mark.urls("tests.api.urls_with_failing_view")
def test_unexpected_errors_are_500_without_internals(
    clients: dict[str, APIClient], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="common.api.errors"):
        response = clients["viewer"].get("/api/v1/failing/", HTTP_X_REQUEST_ID="boom-1")
    assert response.status_code == 500
    error = error_of(response)
    assert error["code"] == "server_error"
    assert "boom-1" in error["message"]
    assert b"hunter2" not in response.content
    assert b"Traceback" not in response.content
    # The operator still finds the cause in the log.
    assert any("hunter2" in (r.exc_text or "") or r.exc_info for r in caplog.records)


@pytest.mark.urls("tests.api.urls_with_failing_view")
def test_djangos_permission_denied_is_403_in_the_shape(clients: dict[str, APIClient]) -> None:
    response = clients["viewer"].get("/api/v1/django-denied/")
    assert response.status_code == 403
    error = error_of(response)
    assert (error["code"], error["message"]) == ("permission_denied", "not on this object")
