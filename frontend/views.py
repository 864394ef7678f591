"""Dashboard pages. Each renders a template; the data comes from the REST API and the live
WebSocket endpoints, so the pages show exactly what an API client sees."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from jobs.models import Job


@login_required
def home(request: HttpRequest) -> HttpResponse:
    return render(request, "frontend/cluster.html", {"nav": "cluster"})


@login_required
def jobs(request: HttpRequest) -> HttpResponse:
    return render(request, "frontend/jobs.html", {"nav": "jobs"})


@login_required
def job(request: HttpRequest, job_id: int) -> HttpResponse:
    return render(request, "frontend/job.html", {"nav": "jobs", "job": get_object_or_404(Job, pk=job_id)})


@login_required
def audit(request: HttpRequest) -> HttpResponse:
    return render(request, "frontend/audit.html", {"nav": "audit"})
