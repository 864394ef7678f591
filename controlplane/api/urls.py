"""All REST routes: /api/v1/ for resources, /api/schema/ and /api/docs/ for the OpenAPI document.
Anything else under /api/ answers a JSON 404 in the API's error shape."""

from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from common.api.errors import api_not_found

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    # The split view serves Swagger UI's start-up script as a file: the CSP allows no inline script.
    path(
        "docs/",
        SpectacularSwaggerSplitView.as_view(
            url_name="api-schema", template_name="controlplane/swagger_ui.html"
        ),
        name="api-docs",
    ),
    path("v1/", include("jobs.urls")),
    path("v1/", include("scheduler.urls")),
    path("v1/", include("agents.urls")),
    path("v1/", include("controlplane.api.v1_urls")),
    # Last: unknown /api/ URLs get the error shape instead of Django's HTML 404.
    re_path(r"", api_not_found, name="api-not-found"),
]
