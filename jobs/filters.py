"""Filters of the job and worker-group lists."""

# mypy: disallow-subclassing-any=False
# (django_filters ships no type information; its base classes are Any.)

from __future__ import annotations

import django_filters

from common.api.filters import ApiFilterSet, BooleanFilter, IdFilter, MultiChoiceFilter, time_range
from jobs.models import Job, JobState, WorkerGroup


class JobFilter(ApiFilterSet):
    state = MultiChoiceFilter(choices=JobState.choices, label="one or more states")
    owner = django_filters.CharFilter(field_name="owner__username", label="owner's username")
    policy = django_filters.CharFilter()
    backend = django_filters.CharFilter()
    name = django_filters.CharFilter(lookup_expr="icontains", label="name contains (case-insensitive)")
    submitted_after, submitted_before = time_range("submitted_at", "submitted")
    ordering = django_filters.OrderingFilter(
        fields=(
            ("submitted_at", "submitted_at"),
            ("priority", "priority"),
            ("name", "name"),
            ("state", "state"),
            ("total_gpus", "total_gpus"),
            ("tokens_per_s", "tokens_per_s"),
            ("id", "id"),
        )
    )

    class Meta:
        model = Job
        fields: list[str] = []


class WorkerGroupFilter(ApiFilterSet):
    job = IdFilter(field_name="job", label="job id")
    kind = django_filters.CharFilter(label="rollout, inference, reward, tool or actor")
    name = django_filters.CharFilter()
    flagged = BooleanFilter()

    class Meta:
        model = WorkerGroup
        fields: list[str] = []
