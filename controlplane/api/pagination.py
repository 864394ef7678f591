"""Page-number pagination with the total count: ``?page=2&page_size=100``."""

# mypy: disallow-subclassing-any=False
# (rest_framework ships no type information; its base classes are Any.)

from __future__ import annotations

from rest_framework.pagination import PageNumberPagination


class PagePagination(PageNumberPagination):
    """``{"count": N, "next": url, "previous": url, "results": [...]}``."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500
