"""All REST routes: /api/v1/ for resources, /api/schema/ and /api/docs/ for the OpenAPI document."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    path("v1/", include("jobs.urls")),
    path("v1/", include("scheduler.urls")),
    path("v1/", include("agents.urls")),
    path("v1/", include("controlplane.api.v1_urls")),
]
