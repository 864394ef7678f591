"""/api/v1/jobs/ and /api/v1/worker-groups/."""

from django.urls import URLPattern, URLResolver
from rest_framework.routers import SimpleRouter

from jobs import api

router = SimpleRouter()
router.register("jobs", api.JobViewSet, basename="job")
router.register("worker-groups", api.WorkerGroupViewSet, basename="worker-group")

urlpatterns: list[URLPattern | URLResolver] = list(router.urls)
