"""Page-number pagination with the total count: ``?page=2&page_size=100``.

``page`` is a whole number from 1 (or ``last``) and ``page_size`` one from 1; anything else is a
400 naming the parameter (DRF would quietly serve the first page, or the default size). A page
past the last one is a 404. Sizes above ``max_page_size`` are served at that size.
"""

# mypy: disallow-subclassing-any=False
# (rest_framework ships no type information; its base classes are Any.)

from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request


def _whole_number_from_1(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if not raw:  # absent or blank: not given
        return None
    try:
        number = int(raw)
    except ValueError:
        number = 0
    if number < 1:
        raise ValidationError({name: ["must be a whole number from 1"]})
    return number


class PagePagination(PageNumberPagination):
    """``{"count": N, "next": url, "previous": url, "results": [...]}``."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def get_page_size(self, request: Request) -> int:
        size = _whole_number_from_1(request, self.page_size_query_param)
        return self.page_size if size is None else min(size, self.max_page_size)

    def get_page_number(self, request: Request, paginator: Paginator[Any]) -> int:
        if request.query_params.get(self.page_query_param) in self.last_page_strings:
            return paginator.num_pages
        return _whole_number_from_1(request, self.page_query_param) or 1

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters: list[dict[str, Any]] = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"]["minimum"] = 1
            if parameter["name"] == self.page_size_query_param:
                parameter["description"] = f"Results per page, at most {self.max_page_size}."
        return parameters
