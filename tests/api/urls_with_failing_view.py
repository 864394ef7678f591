"""The project's URLs plus API views that fail: unexpectedly (a 500) and with Django's own
PermissionDenied (a 403), to see the answers they get."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.urls import include, path
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView


class FailingView(APIView):
    def get(self, request: Request) -> Response:
        raise RuntimeError("secret internals: password=hunter2")


class DjangoDeniedView(APIView):
    def get(self, request: Request) -> Response:
        raise PermissionDenied("not on this object")


urlpatterns = [
    path("api/v1/failing/", FailingView.as_view()),
    path("api/v1/django-denied/", DjangoDeniedView.as_view()),
    path("", include("controlplane.urls")),
]
