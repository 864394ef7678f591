"""Query parameters the database could not take: times with offsets PostgreSQL refuses, times that
fall outside years 1-9999 once in UTC, NUL characters, integers beyond ``bigint``. Each answers
(the same instant in UTC) or is a 400 naming the parameter, on every list that filters by it;
none is a 500. And whoami answers what its schema says."""

from __future__ import annotations

from typing import Any

import django_filters
import pytest
import schemathesis
from django.contrib.auth.models import User
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from common.api.filters import ApiFilterSet, StrictBooleanField
from common.models import ApiToken
from tests.api.conftest import error_of, field_paths
from tests.api.test_schema import generated_schema

pytestmark = pytest.mark.django_db

# The eight lists that filter by time, and the name of their lower bound.
TIME_FILTERED = [
    ("/api/v1/migrations/", "after"),
    ("/api/v1/alerts/", "after"),
    ("/api/v1/audit-events/", "after"),
    ("/api/v1/predictor-samples/", "after"),
    ("/api/v1/jobs/", "submitted_after"),
    ("/api/v1/decisions/", "after"),
    ("/api/v1/snapshots/", "after"),
    ("/api/v1/ticks/", "after"),
]
# -22:21 is a valid ISO 8601 offset, but PostgreSQL refuses offsets of 16 hours or more.
FAR_OFFSET = "2010-12-04T11:27:16-22:21"
SAME_INSTANT_IN_UTC = "2010-12-05T09:48:16Z"


def ids(response: Any) -> list[int]:
    assert response.status_code == 200, response.content
    return [row["id"] for row in response.json()["results"]]


@pytest.mark.parametrize(("path", "after"), TIME_FILTERED)
def test_an_offset_postgresql_refuses_filters_by_the_same_instant(
    clients: dict[str, APIClient], history: dict[str, Any], path: str, after: str
) -> None:
    viewer = clients["admin"]
    found = ids(viewer.get(path, {after: FAR_OFFSET}))
    assert found, "every list has rows from after 2010"
    assert found == ids(viewer.get(path, {after: SAME_INSTANT_IN_UTC}))
    before = after.replace("after", "before")
    assert ids(viewer.get(path, {before: FAR_OFFSET})) == []


@pytest.mark.parametrize(("path", "after"), TIME_FILTERED)
@pytest.mark.parametrize("value", ["0001-01-01T00:00:00+23:00", "9999-12-31T23:59:59-23:59"])
def test_a_time_outside_years_1_to_9999_in_utc_is_a_400_naming_the_parameter(
    clients: dict[str, APIClient], history: dict[str, Any], path: str, after: str, value: str
) -> None:
    response = clients["admin"].get(path, {after: value})
    assert response.status_code == 400, response.content
    assert field_paths(response) == [after]
    assert "out of range" in error_of(response)["fields"][0]["message"]


def test_an_export_filtered_by_an_offset_postgresql_refuses_ends(
    clients: dict[str, APIClient], history: dict[str, Any]
) -> None:
    response = clients["viewer"].get(
        "/api/v1/migrations/export/", {"before": "2875-05-13T17:19:49+21:15", "format": "json"}
    )
    assert response.status_code == 200
    body = b"".join(response.streaming_content).decode()
    assert body.startswith("[") and body.endswith("]")
    assert history["migration"].migration_id in body


def test_a_nul_character_in_the_token_filter_is_a_400_naming_it(
    clients: dict[str, APIClient], users: dict[str, User]
) -> None:
    response = clients["admin"].get("/api/v1/tokens/", {"user": "\x00"})
    assert response.status_code == 400, response.content
    assert field_paths(response) == ["user"]
    assert "NUL" in error_of(response)["message"] or "Null" in error_of(response)["message"]
    mine = clients["admin"].get("/api/v1/tokens/", {"user": "viewer"})
    assert [t["user"] for t in mine.json()["results"]] == ["viewer"]


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/api/v1/audit-events/", {"verb": "job.submit,\x00"}, "verb"),
        ("/api/v1/migrations/", {"strategy": "p2p\x00"}, "strategy"),
        ("/api/v1/nodes/", {"hardware": "H100\x00"}, "hardware"),
        ("/api/v1/jobs/", {"owner": "\x00"}, "owner"),
        ("/api/v1/migrations/", {"job": str(2**63)}, "job"),
        ("/api/v1/devices/", {"job": str(-(2**63) - 1)}, "job"),
        ("/api/v1/migrations/export/", {"after": "0001-01-01T00:00:00+01:00"}, "after"),
        ("/api/v1/audit-events/export/", {"request_id": "\x00"}, "request_id"),
    ],
)
def test_every_kind_of_filter_refuses_what_postgresql_cannot_hold(
    clients: dict[str, APIClient], history: dict[str, Any], path: str, params: dict[str, str], field: str
) -> None:
    response = clients["admin"].get(path, params)
    assert response.status_code == 400, response.content
    assert field_paths(response) == [field]


def test_whoami_matches_its_schema(asgi_app: Any, users: dict[str, User]) -> None:
    _, raw = ApiToken.issue(users["operator"], "whoami")
    operation = schemathesis.openapi.from_dict(generated_schema())["/api/v1/whoami/"]["GET"]
    response = operation.Case(headers={"Authorization": f"Bearer {raw}"}).call(app=asgi_app)
    assert response.status_code == 200
    operation.validate_response(response)
    token = response.json()["token"]
    assert (token["user"], token["active"], token["name"]) == ("operator", True, "whoami")


@pytest.mark.parametrize(
    ("path", "params", "field"),
    [
        ("/api/v1/alerts/", {"open": "-58800"}, "open"),
        ("/api/v1/worker-groups/", {"flagged": "maybe"}, "flagged"),
        ("/api/v1/devices/", {"idle": "\x17"}, "idle"),
        ("/api/v1/jobs/", {"page_size": "null"}, "page_size"),
        ("/api/v1/jobs/", {"page_size": "0"}, "page_size"),
        ("/api/v1/nodes/", {"page": "abc"}, "page"),
        ("/api/v1/nodes/", {"page": "-1"}, "page"),
    ],
)
def test_booleans_and_page_numbers_that_mean_nothing_are_a_400_not_ignored(
    clients: dict[str, APIClient], history: dict[str, Any], path: str, params: dict[str, str], field: str
) -> None:
    response = clients["viewer"].get(path, params)
    assert response.status_code == 400, response.content
    assert field_paths(response) == [field]


def test_blank_parameters_mean_not_given_and_booleans_still_filter(
    clients: dict[str, APIClient], history: dict[str, Any]
) -> None:
    viewer = clients["viewer"]
    everything = ids(viewer.get("/api/v1/alerts/"))
    assert len(everything) == 2
    assert (
        ids(viewer.get("/api/v1/alerts/", {"open": "", "page": "", "page_size": "", "after": ""}))
        == everything
    )
    [open_alert, cleared] = history["alerts"]
    assert ids(viewer.get("/api/v1/alerts/", {"open": "true"})) == [open_alert.pk]
    assert ids(viewer.get("/api/v1/alerts/", {"open": "0"})) == [cleared.pk]
    assert len(ids(viewer.get("/api/v1/jobs/", {"page_size": "100000"}))) == 1  # served at most 500


def _views(patterns: list[URLPattern | URLResolver]) -> list[Any]:
    found = []
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            found += _views(pattern.url_patterns)
        elif hasattr(pattern.callback, "cls"):
            found.append(pattern.callback.cls)
    return found


def test_every_filter_set_of_the_api_refuses_what_postgresql_cannot_hold() -> None:
    """The checks live in ApiFilterSet; a filter set of a view that skipped it, or a boolean
    filter that reads nonsense as 'not given', would bring the 500s (or silence) back."""
    filter_sets = {
        view.filterset_class
        for view in _views(get_resolver().url_patterns)
        if getattr(view, "filterset_class", None)
    }
    assert len(filter_sets) >= 12  # tokens, audit events, nodes, devices, jobs, groups, 6 scheduler lists
    for filter_set in filter_sets:
        assert issubclass(filter_set, ApiFilterSet), filter_set
        for name, declared in filter_set.base_filters.items():
            if isinstance(declared, django_filters.BooleanFilter):
                assert issubclass(declared.field_class, StrictBooleanField), (filter_set, name)
