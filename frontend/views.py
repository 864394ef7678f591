"""Dashboard pages. Each renders a template; the data comes from the REST API and the live
WebSocket endpoints, so the pages show exactly what an API client sees."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from axes.helpers import get_client_username, get_cool_off
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_POST

from common.models import ActorType
from frontend.specmap import error_lines
from jobs.models import Job, JobState
from jobs.services import spec_limits
from scheduler.core.policies import POLICY_NAMES

# Specs offered in the submit form's example picker, read from the repository.
EXAMPLE_SPEC_DIRS = ("examples", "controlplane/demo")
EXAMPLE_SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def example_specs(base_dir: Path | None = None) -> list[dict[str, str]]:
    """``[{"name": "examples/math-7b.yaml", "text": ...}]``: every spec file in the example dirs."""
    root = Path(base_dir or settings.BASE_DIR)
    found: list[dict[str, str]] = []
    for directory in EXAMPLE_SPEC_DIRS:
        for path in sorted((root / directory).glob("*")):
            if path.suffix in EXAMPLE_SPEC_SUFFIXES and path.is_file():
                found.append({"name": f"{directory}/{path.name}", "text": path.read_text()})
    return found


@login_required
def home(request: HttpRequest) -> HttpResponse:
    return render(request, "frontend/cluster.html", {"nav": "cluster"})


@login_required
def jobs(request: HttpRequest) -> HttpResponse:
    context: dict[str, Any] = {
        "nav": "jobs",
        "job_states": [state.value for state in JobState],
        "policies": list(POLICY_NAMES),
        "example_specs": example_specs(),
    }
    return render(request, "frontend/jobs.html", context)


@login_required
def job(request: HttpRequest, job_id: int) -> HttpResponse:
    job = get_object_or_404(Job.objects.select_related("owner"), pk=job_id)
    return render(request, "frontend/job.html", {"nav": "jobs", "job": job})


@login_required
def audit(request: HttpRequest) -> HttpResponse:
    return render(request, "frontend/audit.html", {"nav": "audit", "actor_types": ActorType.choices})


@login_required
@require_POST
def spec_lines(request: HttpRequest) -> JsonResponse:
    """The line of each problem the API reported for a spec text: ``{"spec": "...", "problems":
    [{"path": ..., "message": ...}]}`` -> ``{"lines": [12, null, ...]}`` (same order)."""
    try:
        body = json.loads(request.body)
        text = body["spec"]
        problems = [(str(p.get("path", "")), str(p.get("message", ""))) for p in body["problems"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return JsonResponse(
            {"error": {"status": 400, "message": "expected {spec: text, problems: [{path, message}]}"}},
            status=400,
        )
    if not isinstance(text, str):
        return JsonResponse({"error": {"status": 400, "message": "spec must be text"}}, status=400)
    return JsonResponse({"lines": error_lines(text, problems, limits=spec_limits())})


def _duration(delta: timedelta) -> str:
    """``timedelta(minutes=15)`` -> "15 minutes"."""
    seconds = max(1, round(delta.total_seconds()))
    if seconds % 3600 == 0:
        count, unit = seconds // 3600, "hour"
    elif seconds % 60 == 0 or seconds > 120:
        count, unit = round(seconds / 60), "minute"
    else:
        count, unit = seconds, "second"
    return f"{count} {unit}{'s' if count != 1 else ''}"


def locked_out(
    request: HttpRequest, original_response: HttpResponse | None = None, credentials: Any = None
) -> HttpResponse:
    """django-axes' answer once a username has failed too often from one address (the dashboard's
    and the admin's login): a 429 page saying what happened, for how long, and what to do."""
    cool_off = get_cool_off(request)
    context = {
        "username": get_client_username(request, credentials) or "",
        "failure_limit": settings.AXES_FAILURE_LIMIT,
        "retry_in": _duration(cool_off) if cool_off else None,
    }
    response = render(request, "frontend/locked_out.html", context, status=429)
    if cool_off:
        response["Retry-After"] = str(round(cool_off.total_seconds()))
    return response
