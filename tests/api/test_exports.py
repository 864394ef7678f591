"""Exports: migrations (per migration or per step) and audit events as streamed CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from asgiref.sync import async_to_sync
from django.db import DataError, connection
from django.http import HttpRequest
from django.test import AsyncClient
from rest_framework.test import APIClient

from common.api import exports
from common.models import ActorType, ApiToken, AuditEvent
from scheduler.models import MigrationStep
from tests.api.conftest import error_of, field_paths

pytestmark = pytest.mark.django_db


def streamed(response: Any) -> str:
    assert response.status_code == 200, response.content
    assert response.streaming
    return b"".join(response.streaming_content).decode()


def parse_csv(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_migrations_as_csv_one_row_per_migration(
    clients: dict[str, APIClient], history: dict[str, Any]
) -> None:
    migration = history["migration"]
    response = clients["viewer"].get("/api/v1/migrations/export/", {"format": "csv"})
    assert response["Content-Type"].startswith("text/csv")
    assert 'filename="migrations.csv"' in response["Content-Disposition"]
    [row] = parse_csv(streamed(response))
    assert row["migration_id"] == migration.migration_id
    assert (row["state"], row["donor"], row["recipient"]) == ("committed", "rollout", "actor")
    assert row["device_uids"].split() == migration.device_uids
    assert int(row["steps"]) == migration.steps.count()
    assert row["created_at"].startswith(str(migration.created_at.year))


def test_csv_is_the_default_and_accept_header_works(
    clients: dict[str, APIClient], history: dict[str, Any]
) -> None:
    default = clients["viewer"].get("/api/v1/migrations/export/")
    assert default["Content-Type"].startswith("text/csv")
    by_accept = clients["viewer"].get("/api/v1/migrations/export/", HTTP_ACCEPT="text/csv")
    assert len(parse_csv(streamed(by_accept))) == 1


def test_migrations_as_csv_one_row_per_step(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    migration = history["migration"]
    rows = parse_csv(streamed(clients["viewer"].get("/api/v1/migrations/export/", {"rows": "step"})))
    steps = list(MigrationStep.objects.filter(migration=migration).order_by("index"))
    assert [r["step_id"] for r in rows] == [s.step_id for s in steps]
    assert {r["migration_id"] for r in rows} == {migration.migration_id}
    assert rows[0]["kind"] == "pause_workers"
    assert all(r["state"] == "done" for r in rows)
    assert rows[0]["nodes"].split() == steps[0].nodes


def test_export_applies_the_list_filters(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    none = clients["viewer"].get("/api/v1/migrations/export/", {"state": "failed"})
    assert parse_csv(streamed(none)) == []
    assert streamed(clients["viewer"].get("/api/v1/migrations/export/", {"state": "failed"})).startswith(
        "id,migration_id,"
    )
    job = clients["viewer"].get("/api/v1/migrations/export/", {"job": history["job"].pk, "format": "json"})
    assert len(json.loads(streamed(job))) == 1


def test_migrations_as_json(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    response = clients["viewer"].get("/api/v1/migrations/export/", {"format": "json"})
    assert response["Content-Type"].startswith("application/json")
    [migration] = json.loads(streamed(response))
    assert migration["migration_id"] == history["migration"].migration_id
    assert migration["steps"][0]["kind"] == "pause_workers"
    steps = json.loads(
        streamed(clients["viewer"].get("/api/v1/migrations/export/", {"format": "json", "rows": "step"}))
    )
    assert len(steps) == history["migration"].steps.count()
    assert {s["migration_id"] for s in steps} == {history["migration"].migration_id}


def test_export_errors_are_json_in_the_error_shape(
    clients: dict[str, APIClient], history: dict[str, Any]
) -> None:
    bad = clients["viewer"].get("/api/v1/migrations/export/", {"format": "csv", "rows": "everything"})
    assert bad.status_code == 400
    assert bad["Content-Type"] == "application/json"
    assert field_paths(bad) == ["rows"]
    anonymous = clients["anonymous"].get("/api/v1/migrations/export/", {"format": "csv"})
    assert anonymous.status_code == 401
    assert error_of(anonymous)["code"] == "not_authenticated"
    unknown = clients["viewer"].get("/api/v1/migrations/export/", {"format": "xml"})
    assert unknown.status_code == 404
    assert error_of(unknown)["code"] == "not_found"


def test_audit_events_as_csv(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    job = history["job"]
    clients["operator"].post(
        f"/api/v1/jobs/{job.pk}/pause/", {"detail": 'with "quotes", commas'}, format="json"
    )
    rows = parse_csv(streamed(clients["viewer"].get("/api/v1/audit-events/export/", {"job": job.pk})))
    assert len(rows) == AuditEvent.objects.filter(job=job).count()
    paused = next(r for r in rows if r["verb"] == "job.paused_scheduling")
    assert paused["reason"] == 'with "quotes", commas'
    assert json.loads(paused["payload"]) == {"from": "running", "to": "paused_scheduling"}
    assert paused["request_id"]
    agents_only = parse_csv(
        streamed(clients["viewer"].get("/api/v1/audit-events/export/", {"actor_type": "agent"}))
    )
    assert agents_only and {r["actor_type"] for r in agents_only} == {"agent"}


def test_audit_events_as_json(clients: dict[str, APIClient], history: dict[str, Any]) -> None:
    events = json.loads(
        streamed(
            clients["viewer"].get("/api/v1/audit-events/export/", {"format": "json", "verb": "job.submit"})
        )
    )
    assert [e["verb"] for e in events] == ["job.submit"]
    assert events[0]["actor"] == "operator"


def test_export_streams_under_asgi(history: dict[str, Any], users: dict[str, Any]) -> None:
    """Served by the ASGI handler (as daphne serves it), the body is produced asynchronously."""
    _, raw = ApiToken.issue(users["viewer"], "asgi")

    async def fetch() -> tuple[int, str, bool]:
        response = await AsyncClient().get(
            "/api/v1/migrations/export/", {"rows": "step"}, headers={"Authorization": f"Bearer {raw}"}
        )
        body = b"".join([chunk async for chunk in response.streaming_content])
        return response.status_code, body.decode(), response.is_async

    code, body, is_async = async_to_sync(fetch)()
    assert code == 200
    assert is_async
    assert len(parse_csv(body)) == history["migration"].steps.count()


def test_an_export_whose_query_the_database_refuses_raises_before_it_answers() -> None:
    """Its first chunk is read before the response exists, so the error reaches the view (and
    answers in the error shape) instead of failing a 200 whose body daphne then never ends."""
    beyond = timezone(timedelta(hours=21, minutes=15))  # PostgreSQL takes no literal offset past 15:59

    def lines() -> Iterator[str]:
        yield from exports.csv_lines(
            ("id",), AuditEvent.objects.filter(at__lt=datetime(2875, 5, 13, tzinfo=beyond)).values_list("id")
        )

    with pytest.raises(DataError):
        exports.streaming_response(
            HttpRequest(), lines, content_type=exports.CSV_MEDIA_TYPE, filename="x.csv"
        )


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_an_export_cut_off_by_the_database_ends_short_and_is_logged(
    users: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The database connection dies after the first chunk (its backend is terminated): the body
    ends there, without the JSON array's closing bracket, and the failure is logged."""
    now = datetime.now(UTC)
    AuditEvent.objects.bulk_create(
        AuditEvent(
            at=now,
            actor_type=ActorType.SYSTEM,
            actor="test",
            verb="test.row",
            object_type="x",
            object_id=str(i),
        )
        for i in range(3 * exports.ROWS_PER_CHUNK)
    )
    _, raw = ApiToken.issue(users["viewer"], "export")
    backend = connection.connection.info.backend_pid  # AsyncClient runs the view in this thread
    settings = connection.settings_dict

    def terminate_the_backend() -> None:
        with psycopg.connect(
            host=settings["HOST"] or "127.0.0.1", port=settings["PORT"] or 5432, user=settings["USER"],
            password=settings["PASSWORD"] or None, dbname=settings["NAME"], autocommit=True,
        ) as other:  # fmt: skip
            other.execute("SELECT pg_terminate_backend(%s, 10000)", [backend])

    async def fetch() -> tuple[int, bytes, bytes]:
        response = await AsyncClient().get(
            "/api/v1/audit-events/export/", {"format": "json"}, headers={"Authorization": f"Bearer {raw}"}
        )
        chunks = aiter(response.streaming_content)
        first = await anext(chunks)
        terminate_the_backend()
        rest = b"".join([chunk async for chunk in chunks])
        return response.status_code, first, rest

    try:
        with caplog.at_level(logging.ERROR, logger="common.api.exports"):
            status, first, rest = async_to_sync(fetch)()
    finally:
        connection.close()  # the terminated one; the test database's flush opens another
    assert status == 200
    body = (first + rest).decode()
    assert body.startswith("[") and not body.endswith("]")
    assert 0 < body.count('"verb"') < 3 * exports.ROWS_PER_CHUNK
    assert any("export audit-events.json failed" in record.getMessage() for record in caplog.records)
