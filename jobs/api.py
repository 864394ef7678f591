"""REST endpoints for jobs and their worker groups (under /api/v1/).

Submission takes the spec as a JSON object, as YAML/JSON text (``Content-Type: application/yaml``)
or wrapped as ``{"spec": "<yaml text>"}``, with an optional ``Idempotency-Key`` header: the same
key with the same spec answers 200 with the job it made the first time; with another spec, 409.
Every form of body is read within the same JOB_SPEC_MAX_BYTES (413 over it) and decoded within the
spec's other limits (see ``jobs.spec.DocumentLimits``). The views only translate HTTP to
``jobs.services`` calls. A job's manual migration (``POST /jobs/{id}/migrate/``) is the scheduler's
(``scheduler.api.JobMigrateView``).
"""

# mypy: disallow-subclassing-any=False, disallow-untyped-decorators=False
# (rest_framework ships no type information; its base classes and @action are Any.)

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.db.models import Prefetch, QuerySet
from django.urls import reverse
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.parsers import BaseParser, JSONParser
from rest_framework.request import Request
from rest_framework.response import Response

from common.api.schema import error_response
from common.audit import Actor
from common.bodies import read_limited
from jobs import services
from jobs.filters import JobFilter, WorkerGroupFilter
from jobs.models import Job, WorkerGroup
from jobs.selectors import iteration_results, jobs_with_gpus, with_allocation
from jobs.serializers import (
    IterationResultSerializer,
    JobActionSerializer,
    JobDetailSerializer,
    JobSerializer,
    WorkerGroupSerializer,
)
from jobs.spec import FieldError, SpecError, load_json

IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_KEY_MAX = 200  # Job.idempotency_key's length


# --- request bodies ----------------------------------------------------------------------------


def _spec_body(stream: Any, parser_context: Mapping[str, Any] | None) -> str:
    """The body as text, read within JOB_SPEC_MAX_BYTES whatever its type (a 413 over it)."""
    context = parser_context or {}
    request = context.get("request")
    raw = read_limited(
        stream,
        request.META if request is not None else {},
        limit=settings.JOB_SPEC_MAX_BYTES,
        what="job specs",
        setting="JOB_SPEC_MAX_BYTES",
    )
    encoding = context.get("encoding") or settings.DEFAULT_CHARSET
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ParseError(f"the body is not valid {encoding} text") from exc


class SpecJSONParser(BaseParser):
    """A JSON body, read within JOB_SPEC_MAX_BYTES and decoded by the spec loader: nesting and
    size are bounded before and while decoding, and a key written twice is refused, as in YAML.
    (Not a subclass of DRF's JSONParser, for which DRF reads ``request.body`` first.)"""

    media_type = "application/json"

    def parse(
        self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        try:
            return load_json(_spec_body(stream, parser_context), limits=services.spec_limits())
        except SpecError as exc:
            if isinstance(exc.__cause__, json.JSONDecodeError):
                # A body that is not JSON at all stays a parse error, as for any JSON endpoint.
                raise ParseError(f"JSON parse error - {exc.errors[0].message}") from exc
            raise


class SpecTextParser(BaseParser):
    """A YAML (or JSON) text body, handed to the spec parser as text so that its syntax errors and
    duplicate keys are reported with line and column."""

    media_type = "application/yaml"

    def parse(
        self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> str:
        return _spec_body(stream, parser_context)


class TextYamlParser(SpecTextParser):
    media_type = "text/yaml"


class XYamlParser(SpecTextParser):
    media_type = "application/x-yaml"


def submission_source(data: Any) -> str | dict[str, Any]:
    """What was posted -> what ``submit_job`` takes: YAML/JSON text or a decoded mapping."""
    if isinstance(data, str):
        return data
    if isinstance(data, Mapping):
        if set(data) == {"spec"}:
            inner = data["spec"]
            if isinstance(inner, str):
                return inner
            if isinstance(inner, Mapping):
                return dict(inner)
            raise ValidationError({"spec": ["must be YAML or JSON text, or an object"]})
        return dict(data)
    raise SpecError(
        [FieldError("", f"a job spec must be a mapping at the top level, got {type(data).__name__}")]
    )


def idempotency_key(request: Request) -> str:
    key = str(request.headers.get(IDEMPOTENCY_HEADER, "")).strip()
    if len(key) > IDEMPOTENCY_KEY_MAX:
        raise ValidationError({IDEMPOTENCY_HEADER: [f"at most {IDEMPOTENCY_KEY_MAX} characters"]})
    return key


SPEC_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "JobSpec",
    "description": "A job spec (docs/job-spec.md): dynarl's format (name, model, workload, components, "
    "policy, ...) or RLinf's training config (cluster.component_placement, ...).",
    "properties": {
        "name": {"type": "string"},
        "priority": {"type": "integer"},
        "backend": {"type": "string", "enum": ["sim", "ray"]},
        "model": {"type": "object", "additionalProperties": True},
        "workload": {"type": "object", "additionalProperties": True},
        "components": {"type": "array", "items": {"type": "object", "additionalProperties": True}},
        "policy": {"type": "object", "additionalProperties": True},
        "tick_seconds": {"type": "number"},
        "cluster": {"type": "object", "additionalProperties": True, "description": "RLinf format"},
    },
    "additionalProperties": True,
}
SUBMIT_JSON_SCHEMA: dict[str, Any] = {
    "anyOf": [
        SPEC_OBJECT_SCHEMA,
        {
            "type": "object",
            "title": "WrappedSpec",
            "properties": {
                "spec": {
                    "anyOf": [{"type": "string", "description": "YAML or JSON text"}, SPEC_OBJECT_SCHEMA]
                }
            },
            "required": ["spec"],
        },
    ]
}
SPEC_TEXT_SCHEMA: dict[str, Any] = {"type": "string", "description": "the spec as YAML (or JSON) text"}
EXAMPLE_SPEC: dict[str, Any] = {
    "name": "math-small",
    "model": {"name": "qwen2.5-1.5b", "params_b": 1.5},
    "workload": {"kind": "math", "iterations": 3, "prompts_per_iteration": 64, "samples_per_prompt": 4},
    "components": [
        {"name": "rollout", "kind": "rollout", "workers": 4},
        {"name": "actor", "kind": "actor", "workers": 2, "depends_on": ["rollout"]},
    ],
    "policy": {"name": "dynarl"},
}
EXAMPLE_YAML = """name: math-small
model: {name: qwen2.5-1.5b, params_b: 1.5}
workload: {kind: math, iterations: 3, prompts_per_iteration: 64, samples_per_prompt: 4}
components:
  - {name: rollout, kind: rollout, workers: 4}
  - {name: actor, kind: actor, workers: 2, depends_on: [rollout]}
policy: {name: dynarl}
"""


# --- views -------------------------------------------------------------------------------------

# Only submissions are YAML text; the actions' bodies are small JSON objects.
ACTION_PARSERS = [JSONParser]
JOB_CONFLICT = error_response("The job's state does not allow this (names the current and target state).")


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """RL jobs: submit (operators), list and inspect (viewers), cancel, pause and resume the
    scheduler (operators)."""

    filter_backends = [DjangoFilterBackend]
    filterset_class = JobFilter
    # Submission's parsers; the actions below take plain JSON.
    parser_classes = [SpecJSONParser, SpecTextParser, TextYamlParser, XYamlParser]

    def get_queryset(self) -> QuerySet[Job]:
        jobs = jobs_with_gpus().order_by("-submitted_at", "-id")
        if self.action == "list":
            return jobs
        return jobs.prefetch_related(
            "transitions", Prefetch("groups", queryset=with_allocation(WorkerGroup.objects.order_by("id")))
        )

    def get_serializer_class(self) -> type[JobSerializer]:
        return JobSerializer if self.action == "list" else JobDetailSerializer

    def _detail(self, job_id: int, status_code: int = status.HTTP_200_OK, **headers: str) -> Response:
        job = self.get_queryset().get(pk=job_id)
        return Response(JobDetailSerializer(job).data, status=status_code, headers=headers or None)

    @extend_schema(
        summary="Submit a job",
        request={
            "application/json": SUBMIT_JSON_SCHEMA,
            "application/yaml": SPEC_TEXT_SCHEMA,
            "text/yaml": SPEC_TEXT_SCHEMA,
            "application/x-yaml": SPEC_TEXT_SCHEMA,
        },
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_HEADER,
                str,
                OpenApiParameter.HEADER,
                description="repeat a submission safely: the same key with the same spec answers the "
                "job made the first time (200); with a different spec, 409",
            )
        ],
        responses={
            201: OpenApiResponse(JobDetailSerializer, description="created (and admitted if it fits now)"),
            200: OpenApiResponse(
                JobDetailSerializer, description="this Idempotency-Key made this job before"
            ),
            400: error_response(
                "Invalid spec: `fields` holds each key path at fault (also a document nested too "
                "deep or holding too many values)."
            ),
            409: error_response("The Idempotency-Key was used before with a different spec."),
            413: error_response("The body is larger than JOB_SPEC_MAX_BYTES (the message names it)."),
            422: error_response("A valid spec that can never fit on this cluster."),
        },
        examples=[
            OpenApiExample("dynarl spec as JSON", value=EXAMPLE_SPEC, media_type="application/json"),
            OpenApiExample("wrapped YAML text", value={"spec": EXAMPLE_YAML}, media_type="application/json"),
            OpenApiExample("YAML body", value=EXAMPLE_YAML, media_type="application/yaml"),
        ],
    )
    def create(self, request: Request) -> Response:
        """Validate the spec, record the job and try to admit it at once (gang admission).
        Operators and admins only."""
        source = submission_source(request.data)
        key = idempotency_key(request)
        submission = services.submit_job(
            owner=request.user, source=source, actor=Actor.for_user(request.user), idempotency_key=key
        )
        location = request.build_absolute_uri(reverse("job-detail", args=[submission.job.pk]))
        code = status.HTTP_201_CREATED if submission.created else status.HTTP_200_OK
        return self._detail(submission.job.pk, code, Location=location)

    @extend_schema(request=JobActionSerializer, responses={200: JobDetailSerializer, 409: JOB_CONFLICT})
    @action(detail=True, methods=["post"], parser_classes=ACTION_PARSERS)
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel the job and stop its workers (from any non-terminal state)."""
        job, detail = self._action_target(request)
        services.cancel_job(job.pk, Actor.for_user(request.user), detail)
        return self._detail(job.pk)

    @extend_schema(request=JobActionSerializer, responses={200: JobDetailSerializer, 409: JOB_CONFLICT})
    @action(detail=True, methods=["post"], parser_classes=ACTION_PARSERS)
    def pause(self, request: Request, pk: str | None = None) -> Response:
        """Stop the scheduler from moving GPUs for this job (it keeps running as it is)."""
        job, detail = self._action_target(request)
        services.pause_scheduling(job.pk, Actor.for_user(request.user), detail)
        return self._detail(job.pk)

    @extend_schema(request=JobActionSerializer, responses={200: JobDetailSerializer, 409: JOB_CONFLICT})
    @action(detail=True, methods=["post"], parser_classes=ACTION_PARSERS)
    def resume(self, request: Request, pk: str | None = None) -> Response:
        """Let the scheduler move GPUs for this job again."""
        job, detail = self._action_target(request)
        services.resume_scheduling(job.pk, Actor.for_user(request.user), detail)
        return self._detail(job.pk)

    @extend_schema(
        summary="A real job's results per iteration",
        responses={200: IterationResultSerializer(many=True)},
    )
    @action(detail=True, methods=["get"], url_path="iterations", filter_backends=[], pagination_class=None)
    def iterations(self, request: Request, pk: str | None = None) -> Response:
        """Each iteration's result of a job that really runs (the ray backend), oldest first: mean
        reward, accuracy, response lengths, tokens and phase times as its driver measured them.
        Empty for a simulated job."""
        job = self.get_object()
        return Response(IterationResultSerializer(iteration_results(job), many=True).data)

    def _action_target(self, request: Request) -> tuple[Job, str]:
        job = self.get_object()
        payload = JobActionSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        return job, str(payload.validated_data["detail"])


class WorkerGroupViewSet(viewsets.ReadOnlyModelViewSet):
    """Worker groups (HyperNodes) with their current workers, devices and latest signals;
    filter by ``job``."""

    serializer_class = WorkerGroupSerializer
    filter_backends = [DjangoFilterBackend]
    filterset_class = WorkerGroupFilter

    def get_queryset(self) -> QuerySet[WorkerGroup]:
        return with_allocation(WorkerGroup.objects.order_by("job_id", "id"))
