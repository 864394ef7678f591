"""EngineClient: the one client of a rollout engine, whether a real SGLang server or the CPU engine.

Synchronous (httpx), thread-safe (one connection pool, any number of threads calling at once),
typed: every route has a method, every answer a small dataclass or a plain value, every failure
an :class:`EngineError` naming the route, the HTTP status and the server's message.

Request ids: SGLang aborts by *prefix* — ``/abort_request`` with rid ``r`` (when ``r`` is in
flight) aborts every request whose rid starts with ``r`` — so rids given to one engine must never
be prefixes of each other. ``make_rid`` builds rids that cannot be: fixed-width fields and a
terminating ``.``. (A batch sent with one string rid gets SGLang's ``{rid}_{i}`` expansion, where
``x_1`` is a prefix of ``x_10``; pass a list of rids instead.)

Input-token log-probs (scoring given tokens, e.g. a reference policy's log-probs of a response):
``input_logprobs``/``input_logprobs_batch`` send ``/generate`` with ``return_logprob``,
``max_new_tokens: 0`` and ``logprob_start_len = start - 1``, because SGLang's
``input_token_logprobs`` row at ``logprob_start_len`` is always ``[None, token, None]`` — the
log-prob of the token at ``logprob_start_len`` itself is never given — so asking from one
position earlier and dropping that row yields the log-probs of ``input_ids[start:]``.

Older servers: ``server_info`` and ``loads`` fall back to ``/get_server_info`` and ``/get_load``
when the newer ``/server_info`` and ``/v1/loads`` answer 404.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

PauseMode = Literal["abort", "retract", "in_place"]


class EngineError(RuntimeError):
    """A route answered with an error status, or could not be reached."""

    def __init__(self, route: str, status: int | None, message: str) -> None:
        self.route = route
        self.status = status
        self.message = message
        where = f"HTTP {status}" if status is not None else "unreachable"
        super().__init__(f"{route}: {where}: {message}")


def make_rid(job: str, iteration: int, sample: int, attempt: int = 0, *, prompt: int | None = None) -> str:
    """A request id that no other id from this function is a prefix of (see the module docstring).

    ``prompt`` (optional) names the prompt a sample answers, for rids of grouped samples. The
    terminating ``.`` is what makes the rule hold: ``.`` appears nowhere else, so a rid that were
    a proper prefix of another would put a ``.`` inside it.
    """
    if "." in job:
        raise ValueError(f"job name {job!r} must not contain '.'")
    if min(iteration, sample, attempt, 0 if prompt is None else prompt) < 0:
        raise ValueError("rid fields must be non-negative")
    group = "" if prompt is None else f"-p{prompt:05d}"
    return f"{job}-i{iteration:06d}{group}-s{sample:06d}-a{attempt:03d}."


@dataclass(frozen=True)
class GenerateResult:
    """One ``/generate`` answer, with SGLang's ``meta_info`` parsed."""

    rid: str
    output_ids: list[int]
    finish_reason: dict[str, Any]
    output_logprobs: list[float]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str | None
    weight_versions: list[dict[str, Any]]
    meta_info: dict[str, Any] = field(repr=False)
    # ``meta_info.input_token_logprobs`` split into its columns (empty unless asked for with
    # return_logprob; the first value is None, as SGLang gives it).
    input_token_logprobs: list[float | None] = field(default_factory=list, repr=False)
    input_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def finish_type(self) -> str:
        """'stop', 'length' or 'abort'."""
        return str(self.finish_reason.get("type", ""))

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"

    def token_weight_versions(self) -> list[str | None]:
        """The weight version each output token was generated under (None where the server did
        not say: a server without per-token spans reports one version for the request)."""
        versions: list[str | None] = [None] * len(self.output_ids)
        if not self.weight_versions:
            return [self.weight_version] * len(self.output_ids)
        for span in self.weight_versions:
            for index in range(int(span["start"]), min(int(span["end"]), len(versions))):
                versions[index] = str(span["version"])
        return versions

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> GenerateResult:
        meta = payload.get("meta_info") or {}
        output_ids = [int(token) for token in payload.get("output_ids") or []]
        # A max_new_tokens=0 request may carry a row for SGLang's dummy (never returned) token.
        logprob_rows = (meta.get("output_token_logprobs") or [])[: len(output_ids)]
        input_rows = meta.get("input_token_logprobs") or []
        version = meta.get("weight_version")
        return cls(
            rid=str(meta.get("id", "")),
            output_ids=output_ids,
            finish_reason=dict(meta.get("finish_reason") or {}),
            output_logprobs=[float(row[0]) for row in logprob_rows],
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=None if version is None else str(version),
            weight_versions=list(meta.get("weight_versions") or []),
            meta_info=meta,
            input_token_logprobs=[None if row[0] is None else float(row[0]) for row in input_rows],
            input_token_ids=[int(row[1]) for row in input_rows],
        )


@dataclass(frozen=True)
class InputLogprobs:
    """Log-probs the engine's current weights give the tokens ``input_ids[start:]`` of a
    sequence, each conditioned on everything before it (what ``EngineClient.input_logprobs``
    returns)."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    weight_version: str | None
    cached_tokens: int

    @classmethod
    def from_result(cls, result: GenerateResult, input_ids: list[int], start: int) -> InputLogprobs:
        """Check the answer of a ``logprob_start_len = start - 1`` request and drop its None row."""
        expected = input_ids[start - 1 :]
        if result.aborted:
            raise EngineError(
                "/generate", None, f"scoring request {result.rid!r} was aborted: {result.finish_reason}"
            )
        if result.input_token_ids != expected or len(result.input_token_logprobs) != len(expected):
            raise EngineError(
                "/generate",
                None,
                f"input_token_logprobs cover tokens {result.input_token_ids[:8]}... "
                f"({len(result.input_token_ids)} rows), expected input_ids[{start - 1}:] "
                f"({len(expected)} tokens): the server does not shape them as SGLang does",
            )
        logprobs = result.input_token_logprobs[1:]
        if any(value is None for value in logprobs):
            raise EngineError("/generate", None, "input_token_logprobs has None past its first row")
        return cls(
            start=start,
            token_ids=list(input_ids[start:]),
            logprobs=[float(value) for value in logprobs if value is not None],
            weight_version=result.weight_version,
            cached_tokens=result.cached_tokens,
        )


@dataclass(frozen=True)
class EngineLoad:
    """What ``/v1/loads`` (or the older ``/get_load``) says, summed over data-parallel ranks."""

    num_running_reqs: int
    num_waiting_reqs: int
    max_running_requests: int | None
    gen_throughput: float | None
    utilization: float | None
    raw: dict[str, Any] | list[Any] = field(repr=False)
    from_old_route: bool = False


@dataclass(frozen=True)
class WeightUpdateResult:
    success: bool
    message: str


class EngineClient:
    """Typed client of SGLang's HTTP control protocol."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, generate_timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        # The pool never closes a connection of its own accord: httpcore's pool may close an idle
        # connection it has just handed to a waiting request (encode/httpcore#1110), and that
        # request then reads a closed socket ([Errno 9] Bad file descriptor). It closes them as
        # surplus keep-alives (counted over all connections, so under any concurrency above 20),
        # to make room, and once idle past the keep-alive expiry; none of the three applies
        # here. The callers bound their concurrency themselves (a rollout's slots per engine), so
        # the pool holds at most one connection per concurrent caller; one the engine closed is
        # still dropped when next looked at.
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=None),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _request(
        self,
        method: str,
        route: str,
        body: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        accept: tuple[int, ...] = (200,),
    ) -> httpx.Response:
        try:
            response = self._http.request(
                method, route, json=body, timeout=timeout_s if timeout_s is not None else self.timeout_s
            )
        except httpx.TimeoutException as error:
            raise EngineError(
                route, None, f"no answer within {timeout_s or self.timeout_s} s ({error})"
            ) from error
        except httpx.HTTPError as error:
            raise EngineError(route, None, f"{type(error).__name__}: {error}") from error
        if response.status_code not in accept:
            raise EngineError(route, response.status_code, _error_message(response))
        return response

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        timeout_s: float | None = None,
        logprob_start_len: int | None = None,
    ) -> GenerateResult:
        """``logprob_start_len`` (with ``return_logprob``): return ``input_token_logprobs`` from
        that prompt position on (SGLang's field; None sends nothing: its default -1)."""
        body = _generate_body(input_ids, sampling_params, rid, return_logprob, logprob_start_len)
        response = self._request("POST", "/generate", body, timeout_s or self.generate_timeout_s)
        return GenerateResult.from_json(response.json())

    def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        rids: list[str] | None = None,
        return_logprob: bool = False,
        timeout_s: float | None = None,
        logprob_start_len: int | list[int] | None = None,
    ) -> list[GenerateResult]:
        """One ``/generate`` call for many prompts; results in the order of ``input_ids``."""
        if not input_ids:
            return []
        body = _generate_body(input_ids, sampling_params, rids, return_logprob, logprob_start_len)
        response = self._request("POST", "/generate", body, timeout_s or self.generate_timeout_s)
        payload = response.json()
        if not isinstance(payload, list):
            raise EngineError("/generate", response.status_code, "a batch answer must be a list")
        return [GenerateResult.from_json(item) for item in payload]

    def input_logprobs(
        self, input_ids: list[int], start: int, rid: str | None = None, timeout_s: float | None = None
    ) -> InputLogprobs:
        """Log-probs of ``input_ids[start:]`` under the served weights, each given the tokens
        before it (one prefill, nothing generated). ``start`` >= 1: the first token has no
        log-prob. For a prompt + response, ``start = len(prompt)`` scores the response."""
        _check_start(input_ids, start)
        result = self.generate(
            input_ids,
            {"max_new_tokens": 0},
            rid=rid,
            return_logprob=True,
            timeout_s=timeout_s,
            logprob_start_len=start - 1,
        )
        return InputLogprobs.from_result(result, input_ids, start)

    def input_logprobs_batch(
        self,
        input_ids: list[list[int]],
        starts: list[int],
        rids: list[str] | None = None,
        timeout_s: float | None = None,
    ) -> list[InputLogprobs]:
        """:meth:`input_logprobs` for many sequences in one ``/generate`` call, in order."""
        if len(starts) != len(input_ids):
            raise ValueError(f"{len(starts)} starts for {len(input_ids)} sequences")
        for sequence, start in zip(input_ids, starts, strict=True):
            _check_start(sequence, start)
        results = self.generate_batch(
            input_ids,
            {"max_new_tokens": 0},
            rids=rids,
            return_logprob=True,
            timeout_s=timeout_s,
            logprob_start_len=[start - 1 for start in starts],
        )
        return [
            InputLogprobs.from_result(result, sequence, start)
            for result, sequence, start in zip(results, input_ids, starts, strict=True)
        ]

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort ``rid`` and every request whose rid starts with it (SGLang's prefix rule; a rid
        that is not in flight aborts nothing), or everything with ``abort_all``."""
        self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._request("POST", "/continue_generation", {})

    def flush_cache(self) -> bool:
        """True when flushed; False when the server declined (requests in flight)."""
        response = self._request("POST", "/flush_cache", accept=(200, 400))
        return response.status_code == 200

    def slow_down(self, forward_sleep_time: float | None) -> None:
        """SGLang's testing aid: sleep this long after every forward step (None: stop)."""
        self._request("POST", "/slow_down", {"forward_sleep_time": forward_sleep_time})

    # ------------------------------------------------------------------ weights

    def _weight_call(self, route: str, body: dict[str, Any], timeout_s: float | None) -> WeightUpdateResult:
        response = self._request("POST", route, body, timeout_s, accept=(200, 400))
        payload = response.json()
        result = WeightUpdateResult(bool(payload.get("success")), str(payload.get("message", "")))
        if not result.success:
            raise EngineError(route, response.status_code, result.message)
        return result

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> WeightUpdateResult:
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._weight_call("/update_weights_from_disk", body, timeout_s or self.generate_timeout_s)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
        timeout_s: float | None = None,
    ) -> WeightUpdateResult:
        """Blocks until every rank (the trainer is rank 0) has joined the group."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return self._weight_call("/init_weights_update_group", body, timeout_s or self.generate_timeout_s)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> WeightUpdateResult:
        return self._weight_call("/destroy_weights_update_group", {"group_name": group_name}, None)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> WeightUpdateResult:
        """Returns once the engine received the broadcasts rank 0 makes meanwhile, in ``names`` order."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._weight_call(
            "/update_weights_from_distributed", body, timeout_s or self.generate_timeout_s
        )

    # ------------------------------------------------------------------ memory

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._request("POST", "/release_memory_occupation", {"tags": tags} if tags else {})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._request("POST", "/resume_memory_occupation", {"tags": tags} if tags else {})

    # ------------------------------------------------------------------ state

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def health_generate(self) -> bool:
        try:
            return self._http.get("/health_generate", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_until_healthy(self, timeout_s: float = 60.0, interval_s: float = 0.2) -> None:
        """Poll ``/health`` (a server that is starting has nothing to wait on but its port)."""
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise EngineError("/health", None, f"not healthy within {timeout_s} s at {self.base_url}")
            time.sleep(interval_s)

    def server_info(self) -> dict[str, Any]:
        response = self._request("GET", "/server_info", accept=(200, 404))
        if response.status_code == 404:
            response = self._request("GET", "/get_server_info")
        info: dict[str, Any] = response.json()
        return info

    def weight_version(self) -> str:
        return str(self.server_info().get("weight_version"))

    def loads(self) -> EngineLoad:
        response = self._request("GET", "/v1/loads", accept=(200, 404))
        if response.status_code == 404:
            old: list[dict[str, Any]] = self._request("GET", "/get_load").json()
            waiting = sum(int(rank.get("num_waiting_reqs", 0)) for rank in old)
            return EngineLoad(
                num_running_reqs=sum(int(rank.get("num_reqs", 0)) for rank in old) - waiting,
                num_waiting_reqs=waiting,
                max_running_requests=None,
                gen_throughput=None,
                utilization=None,
                raw=old,
                from_old_route=True,
            )
        payload: dict[str, Any] = response.json()
        ranks: list[dict[str, Any]] = payload.get("loads") or []
        limits = [
            int(rank["max_running_requests"])
            for rank in ranks
            if rank.get("max_running_requests") is not None
        ]
        throughputs = [
            float(rank["gen_throughput"]) for rank in ranks if rank.get("gen_throughput") is not None
        ]
        utilizations = [float(rank["utilization"]) for rank in ranks if rank.get("utilization") is not None]
        return EngineLoad(
            num_running_reqs=sum(int(rank.get("num_running_reqs", 0)) for rank in ranks),
            num_waiting_reqs=sum(int(rank.get("num_waiting_reqs", 0)) for rank in ranks),
            # A total only when every rank reported its part.
            max_running_requests=sum(limits) if ranks and len(limits) == len(ranks) else None,
            gen_throughput=sum(throughputs) if ranks and len(throughputs) == len(ranks) else None,
            utilization=sum(utilizations) / len(utilizations) if utilizations else None,
            raw=payload,
        )


def _error_message(response: httpx.Response) -> str:
    """The server's own words: SGLang answers {"error": {"message"}}, {"message"} or plain text."""
    try:
        payload = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail"):
            if key in payload:
                return str(payload[key])
    return str(payload)


def _generate_body(
    input_ids: list[int] | list[list[int]],
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
    rid: str | list[str] | None,
    return_logprob: bool,
    logprob_start_len: int | list[int] | None = None,
) -> dict[str, Any]:
    """A ``/generate`` request, single or batch (SGLang takes both in the same fields)."""
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params or {},
        "return_logprob": return_logprob,
        "stream": False,
    }
    if rid is not None:
        body["rid"] = rid
    if logprob_start_len is not None:
        body["logprob_start_len"] = logprob_start_len
    return body


def _check_start(input_ids: list[int], start: int) -> None:
    if not 1 <= start <= len(input_ids):
        raise ValueError(
            f"start must be in [1, {len(input_ids)}] for {len(input_ids)} tokens (the first token has "
            f"no log-prob), got {start}"
        )
