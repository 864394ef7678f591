"""A small HTTP client for the dynarl REST API on the standard library (``urllib.request``).

Every answer that is not 2xx becomes :class:`ApiError`, carrying the API's one error shape
(``{"error": {"status", "code", "message", "fields": [{"path", "message"}], "request_id"}}``);
a server that cannot be reached becomes :class:`Unreachable`.
"""

from __future__ import annotations

import http.cookiejar
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

USER_AGENT = "dynarl-cli/1"
DEFAULT_TIMEOUT_S = 60.0

Query = Mapping[str, str | int | Sequence[str] | None]


@dataclass(frozen=True)
class FieldProblem:
    path: str
    message: str


@dataclass
class ApiError(Exception):
    """The server answered with an error (4xx/5xx)."""

    status: int
    code: str
    message: str
    fields: list[FieldProblem] = field(default_factory=list)
    request_id: str = ""

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    @classmethod
    def from_response(cls, status: int, reason: str, body: bytes, request_id: str) -> ApiError:
        try:
            error = json.loads(body.decode("utf-8"))["error"]
            return cls(
                status=int(error.get("status", status)),
                code=str(error.get("code", "error")),
                message=str(error.get("message", reason)),
                fields=[
                    FieldProblem(str(f.get("path", "")), str(f.get("message", "")))
                    for f in error.get("fields") or []
                ],
                request_id=str(error.get("request_id") or request_id),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            # Not the API's error shape (a proxy, or a page that is not the API): say what came back,
            # an HTML page by its title.
            text = re.sub(r"\s+", " ", body.decode("utf-8", "replace")).strip()
            if text.startswith("<"):
                title = re.search(r"<title>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
                text = title.group(1).strip() if title else ""
            detail = f": {text[:200]}" if text and text not in f"{status} {reason}" else ""
            return cls(status, "http_error", f"HTTP {status} {reason}{detail}", [], request_id)


class Unreachable(Exception):
    """No answer from the server (refused, DNS, timeout, TLS)."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode("utf-8"))


def encode_query(query: Query | None) -> str:
    pairs: list[tuple[str, str]] = []
    for key, value in (query or {}).items():
        if value is None:
            continue
        if isinstance(value, str | int):
            pairs.append((key, str(value)))
        else:
            pairs.extend((key, str(item)) for item in value)
    return urllib.parse.urlencode(pairs)


class ApiClient:
    """Requests against ``base_url`` (e.g. ``http://127.0.0.1:8000``), with a bearer token when
    given. ``opener`` lets the login flow keep cookies."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        opener: urllib.request.OpenerDirector | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.opener = opener or urllib.request.build_opener()

    def url(self, path: str, query: Query | None = None) -> str:
        """``path`` under the base URL, or as it is when absolute (a list's ``next`` link)."""
        encoded = encode_query(query)
        absolute = path if path.startswith(("http://", "https://")) else f"{self.base_url}/{path.lstrip('/')}"
        if not encoded:
            return absolute
        return absolute + ("&" if "?" in absolute else "?") + encoded

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Query | None = None,
        json_body: Any = None,
        body: bytes | None = None,
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        extra = dict(headers or {})
        if json_body is not None:
            body = json.dumps(json_body).encode("utf-8")
            content_type = "application/json"
        if content_type:
            extra["Content-Type"] = content_type
        request = urllib.request.Request(
            self.url(path, query), data=body, headers=self._headers(extra), method=method
        )
        with self._open(request) as answer:
            return Response(answer.status, dict(answer.headers.items()), answer.read())

    def _headers(self, extra: Mapping[str, str]) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        headers.update(extra)
        return headers

    @contextmanager
    def _open(self, request: urllib.request.Request) -> Iterator[Any]:
        try:
            answer = self.opener.open(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            payload = exc.read()
            request_id = exc.headers.get("X-Request-ID", "") if exc.headers else ""
            raise ApiError.from_response(exc.code, str(exc.reason), payload, request_id) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise Unreachable(f"cannot reach {self.base_url}: {reason}") from None
        with answer:
            yield answer

    def download(
        self, path: str, sink: BinaryIO, query: Query | None = None, chunk_bytes: int = 1 << 16
    ) -> int:
        """Copy a (streamed) body to ``sink`` as it arrives; returns the bytes written."""
        request = urllib.request.Request(
            self.url(path, query), headers=self._headers({"Accept": "*/*"}), method="GET"
        )
        written = 0
        with self._open(request) as answer:
            while chunk := answer.read(chunk_bytes):
                sink.write(chunk)
                written += len(chunk)
        return written

    def get(self, path: str, query: Query | None = None) -> Any:
        return self.request("GET", path, query=query).json()

    def post(self, path: str, payload: Any = None, *, headers: Mapping[str, str] | None = None) -> Any:
        return self.request(
            "POST", path, json_body=payload if payload is not None else {}, headers=headers
        ).json()

    def paginate(self, path: str, query: Query | None = None, *, limit: int = 0) -> Iterator[dict[str, Any]]:
        """Items of a paginated list, following ``next`` until ``limit`` items (0: all)."""
        page: Any = self.get(path, query)
        served = 0
        while True:
            for item in page["results"]:
                if limit and served >= limit:
                    return
                served += 1
                yield item
            if not page.get("next"):
                return
            page = self.get(page["next"])


def session_opener() -> tuple[urllib.request.OpenerDirector, http.cookiejar.CookieJar]:
    jar = http.cookiejar.CookieJar()
    return urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar)), jar


def cookie(jar: http.cookiejar.CookieJar, name: str) -> str | None:
    return next((c.value for c in jar if c.name == name), None)
