"""The OpenAPI document: it validates without warnings, documents the error shape, and every
operation it lists answers (never 5xx) with a status it documents."""

from __future__ import annotations

import functools
from io import StringIO
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


@functools.cache
def generated_schema() -> dict[str, Any]:
    """Generated once per run (it does not depend on the data)."""
    out = StringIO()
    call_command("spectacular", "--validate", "--fail-on-warn", stdout=out)
    schema: dict[str, Any] = yaml.safe_load(out.getvalue())
    return schema


def test_schema_validates_without_warnings() -> None:
    schema = generated_schema()
    assert schema["openapi"].startswith("3.")
    assert "/api/v1/jobs/" in schema["paths"]


def test_schema_and_swagger_ui_are_served(clients: dict[str, APIClient]) -> None:
    response = clients["anonymous"].get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    assert "/api/v1/migrations/export/" in response.json()["paths"]
    docs = clients["anonymous"].get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger" in docs.content.lower()


def test_error_shape_is_a_component_used_by_every_operation() -> None:
    schema = generated_schema()
    assert set(schema["components"]["schemas"]["Error"]["properties"]) == {"error"}
    error_ref = "#/components/schemas/Error"
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method == "parameters":
                continue
            for code in ("401", "403"):
                content = operation["responses"][code]["content"]["application/json"]
                assert content["schema"]["$ref"] == error_ref, (method, path, code)


def test_job_submission_documents_every_body_format_and_outcome() -> None:
    operation = generated_schema()["paths"]["/api/v1/jobs/"]["post"]
    assert set(operation["requestBody"]["content"]) >= {"application/json", "application/yaml", "text/yaml"}
    assert {"200", "201", "400", "409", "422"} <= set(operation["responses"])
    assert any(p["name"] == "Idempotency-Key" and p["in"] == "header" for p in operation["parameters"])


def test_exports_document_csv_and_json() -> None:
    paths = generated_schema()["paths"]
    for path in ("/api/v1/migrations/export/", "/api/v1/audit-events/export/"):
        content = paths[path]["get"]["responses"]["200"]["content"]
        assert set(content) == {"text/csv", "application/json"}, path


def _sample_path(path: str, ids: dict[str, Any]) -> str:
    """Fill ``{id}`` with an existing row of the resource the path names."""
    if "{id}" not in path:
        return path
    resource = path.removeprefix("/api/v1/").split("/")[0]
    return path.replace("{id}", str(ids[resource]))


def test_every_documented_operation_answers_as_documented(
    history: dict[str, Any], clients: dict[str, APIClient], users: dict[str, Any]
) -> None:
    from cluster.models import Device, Node
    from common.models import ApiToken, AuditEvent
    from jobs.models import WorkerGroup

    job = history["job"]
    ids = {
        "jobs": job.pk,
        "worker-groups": WorkerGroup.objects.filter(job=job).first().pk,  # type: ignore[union-attr]
        "nodes": Node.objects.first().pk,  # type: ignore[union-attr]
        "devices": Device.objects.first().pk,  # type: ignore[union-attr]
        "snapshots": history["snapshots"][0].pk,
        "decisions": history["decision"].pk,
        "migrations": history["migration"].pk,
        "predictor-samples": history["samples"][0].pk,
        "ticks": history["tick"].pk,
        "alerts": history["alerts"][0].pk,
        "audit-events": AuditEvent.objects.first().pk,  # type: ignore[union-attr]
        "tokens": ApiToken.objects.filter(user=users["admin"]).first().pk,  # type: ignore[union-attr]
    }
    query = {"/api/v1/snapshots/latest/": {"job": job.pk}}
    admin = clients["admin"]
    schema = generated_schema()
    checked = 0
    # Reads first, then writes (a cancel must not run before the reads of the running job).
    operations = [
        (path, method, operation)
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
        if method in ("get", "post", "put", "patch", "delete")
    ]
    operations.sort(key=lambda op: (op[1] != "get", "cancel" in op[0]))
    for path, method, operation in operations:
        url = _sample_path(path, ids)
        if method == "get":
            response = admin.get(url, query.get(path, {}))
        else:
            response = getattr(admin, method)(url, {}, format="json")
        assert response.status_code < 500, (method, path, response.status_code)
        assert str(response.status_code) in operation["responses"], (
            method,
            path,
            response.status_code,
            list(operation["responses"]),
        )
        if method == "get":
            assert response.status_code == 200, (path, response.content[:300])
        checked += 1
    assert checked >= 35
