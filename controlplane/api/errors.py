"""The API's exception handler (DRF's EXCEPTION_HANDLER): the apps' own exceptions — bad specs,
refused submissions, idempotency conflicts, refused manual migrations — as 4xx answers naming the
field at fault, and everything else as ``common.api.errors`` answers it, in the same shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework import status
from rest_framework.response import Response

from common.api.errors import ApiError, FieldProblem, handle_exception, summarise
from jobs.services import IdempotencyConflict, SubmissionRefused
from jobs.spec import SpecError
from scheduler.services.gpu_migrations import ManualMigrationError


def domain_error(exc: BaseException) -> ApiError | None:
    """The answer to one of the apps' exceptions; None for any other."""
    if isinstance(exc, SpecError):
        fields = tuple(FieldProblem(e.path, e.message) for e in exc.errors)
        count = len(fields)
        message = f"invalid job spec ({count} problem{'s' if count != 1 else ''}): " + summarise(fields, "")
        return ApiError(status.HTTP_400_BAD_REQUEST, "invalid_spec", message, fields)
    if isinstance(exc, SubmissionRefused):
        problem = FieldProblem(exc.field, exc.message)
        return ApiError(
            status.HTTP_422_UNPROCESSABLE_ENTITY, "unschedulable", summarise([problem], ""), (problem,)
        )
    if isinstance(exc, IdempotencyConflict):
        key = str(exc.args[0]) if exc.args else ""
        problem = FieldProblem(
            "Idempotency-Key", f"{key!r} was already used for a different spec; use a new key"
        )
        return ApiError(status.HTTP_409_CONFLICT, "idempotency_conflict", problem.message, (problem,))
    if isinstance(exc, ManualMigrationError):
        problem = FieldProblem(exc.field, exc.message)
        return ApiError(status.HTTP_400_BAD_REQUEST, "invalid", summarise([problem], ""), (problem,))
    return None


def exception_handler(exc: Exception, context: Mapping[str, Any]) -> Response:
    return handle_exception(exc, context, domain_error)
