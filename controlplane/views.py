from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from controlplane import health


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """200 when every service answers; 503 naming the ones that do not."""
    results = health.run_checks()
    failing = [r.name for r in results if not r.ok]
    body = {
        "status": "ok" if not failing else "unavailable",
        "failing": failing,
        "checks": {r.name: r.to_json() for r in results},
    }
    return JsonResponse(body, status=503 if failing else 200)
