"""OpenAPI pieces shared by every endpoint: the error shape as a component, and an AutoSchema that
documents it for the error statuses every operation can answer."""

# mypy: disallow-subclassing-any=False
# (rest_framework and drf_spectacular ship no or partial type information; base classes are Any.)

from __future__ import annotations

from typing import Any, Literal

from drf_spectacular.contrib.django_filters import DjangoFilterExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers


class ErrorFieldSerializer(serializers.Serializer):
    path = serializers.CharField(
        help_text="where the problem is: a key path such as components[1].parallelism.tp, a body "
        "field, a query parameter or a header; empty for the document as a whole"
    )
    message = serializers.CharField()


class ErrorDetailSerializer(serializers.Serializer):
    status = serializers.IntegerField(help_text="the HTTP status, repeated")
    code = serializers.CharField(
        help_text="machine-readable: invalid, invalid_spec, not_authenticated, authentication_failed, "
        "permission_denied, not_found, method_not_allowed, unsupported_media_type, "
        "idempotency_conflict, illegal_transition, unschedulable, server_error, ..."
    )
    message = serializers.CharField()
    fields = ErrorFieldSerializer(many=True)
    request_id = serializers.CharField(help_text="also in the X-Request-ID response header")


class ErrorSerializer(serializers.Serializer):
    """Every 4xx and 5xx answer of this API has this shape."""

    error = ErrorDetailSerializer()


def error_response(description: str) -> OpenApiResponse:
    return OpenApiResponse(response=ErrorSerializer, description=description)


COMMON_ERRORS: dict[str, str] = {
    "400": "Invalid input; `fields` names each parameter or body field at fault.",
    "401": "No credentials, or an invalid, expired or revoked token.",
    "403": "Authenticated, but the role does not allow this.",
}
NOT_FOUND = "No such object."
NO_SUCH_PAGE = "No such page: `page` is past the last one."
NO_SUCH_FORMAT = "No such format: `format` names none of the documented ones."


NO_NUL_PATTERN = "^[^\\x00]*$"


class ApiAutoSchema(AutoSchema):
    """Adds the documented error responses (in the one error shape) to every operation, and says
    of every optional query parameter that a blank value is allowed: it means the parameter was
    not given, as django-filter, DRF's serializers and its pagination all read it (and as HTML
    forms send it)."""

    def _get_parameters(self) -> list[dict[str, Any]]:
        parameters: list[dict[str, Any]] = super()._get_parameters()
        for parameter in parameters:
            if parameter["in"] != "query":
                continue
            if not parameter.get("required"):
                parameter["allowEmptyValue"] = True
            schema = parameter.get("schema", {})
            for part in (schema, schema.get("items", {})):
                if part.get("type") == "string" and not {"format", "enum", "pattern"} & set(part):
                    # PostgreSQL text cannot hold NUL, so a query value with one is refused (400).
                    part["pattern"] = NO_NUL_PATTERN
        return parameters

    def _get_response_bodies(self, direction: Literal["request", "response"] = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        errors = dict(COMMON_ERRORS)
        not_found = []
        if "{" in self.path:
            not_found.append(NOT_FOUND)
        if self.method == "GET" and self._is_list_view() and self._get_paginator() is not None:  # type: ignore[no-untyped-call]
            not_found.append(NO_SUCH_PAGE)
        if len(self.map_renderers("format")) > 1:  # ``?format=`` picks one; another one is a 404
            not_found.append(NO_SUCH_FORMAT)
        if not_found:
            errors["404"] = " ".join(not_found)
        for code, description in errors.items():
            if code not in responses:
                responses[code] = self._get_response_for_code(  # type: ignore[no-untyped-call]
                    error_response(description), code, media_types=["application/json"], direction=direction
                )
        return responses


class BoundedFilterExtension(DjangoFilterExtension):  # type: ignore[no-untyped-call]
    """django-filter parameters as drf-spectacular documents them, plus the bounds of filters
    whose form field has ``min_value``/``max_value`` (ids: a ``bigint``)."""

    priority = 1

    def resolve_filter_field(
        self, auto_schema: Any, model: Any, filterset_class: Any, field_name: str, filter_field: Any
    ) -> list[dict[str, Any]]:
        parameters: list[dict[str, Any]] = super().resolve_filter_field(  # type: ignore[no-untyped-call]
            auto_schema, model, filterset_class, field_name, filter_field
        )
        bounds = {
            "minimum": filter_field.extra.get("min_value"),
            "maximum": filter_field.extra.get("max_value"),
        }
        for parameter in parameters:
            if parameter["schema"].get("type") == "integer":
                parameter["schema"].update({key: value for key, value in bounds.items() if value is not None})
        return parameters
