from django.contrib import admin
from django.urls import include, path

from controlplane.metrics import metrics_view
from controlplane.views import healthz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/", include("controlplane.api.urls")),
    path("", include("frontend.urls")),
]
