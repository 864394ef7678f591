"""SGLang's HTTP routes in front of the CPU engine (FastAPI + uvicorn, as SGLang itself uses).

Routes, request fields and answers follow SGLang's ``http_server.py`` and ``io_struct.py`` (see
the package docstring for the version read). Differences a caller can notice:

- input is token ids only (``text`` is refused: the CPU engine has no tokenizer) and there is no
  streaming; answers carry ``output_ids`` and ``meta_info`` but no ``text``;
- generation while the engine's memory is released is refused with 400 instead of hanging;
- a client that disconnects does not abort its request (call ``/abort_request``).

``/generate`` takes ``return_logprob``, ``logprob_start_len`` and ``max_new_tokens: 0`` as SGLang
does (see the package docstring for the semantics and the source read).

Run standalone: ``python -m runtime.engine.cpu_server --port 0 --config '{"vocab_size": ...}'``
prints one JSON line ``{"url": ...}`` once it listens, then serves until terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from runtime.engine.cpu_engine import CpuEngine, EngineRequestError, EngineSettings, Sequence
from runtime.engine.model import GPTConfig
from runtime.engine.sampling import SamplingParams

ENGINE_NAME = "dynarl-cpu-engine"
PROTOCOL_VERSION = "0.5"  # the SGLang protocol generation these routes follow
HEALTH_CHECK_TIMEOUT_S = 20.0


def _error(message: str, status_code: int = 400) -> JSONResponse:
    # SGLang's _create_error_response shape.
    return JSONResponse({"error": {"message": message}}, status_code=status_code)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise EngineRequestError("the request body must be a JSON object")
    return body


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    """SGLang's batch normalisation: one value for every item, or a list of one per item."""
    if isinstance(value, list):
        if len(value) != count:
            raise EngineRequestError(f"{name} has {len(value)} entries for a batch of {count}")
        return value
    return [value] * count


@dataclasses.dataclass(frozen=True)
class GenerateItem:
    """One request of a /generate body, after SGLang's batch normalisation."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # SGLang's default: no input-token log-probs but the last


def parse_generate_body(body: dict[str, Any]) -> tuple[bool, list[GenerateItem]]:
    """(is_single, the requests) from a /generate body."""
    if body.get("text") is not None or body.get("input_embeds") is not None:
        raise EngineRequestError("the CPU engine takes input_ids only (it has no tokenizer)")
    if body.get("stream"):
        raise EngineRequestError("the CPU engine does not stream; send stream=false")
    input_ids = body.get("input_ids")
    if not isinstance(input_ids, list) or not input_ids:
        raise EngineRequestError("input_ids must be a non-empty list of token ids (or a list of them)")
    is_single = not isinstance(input_ids[0], list)
    batch: list[list[int]] = [input_ids] if is_single else input_ids
    for item in batch:
        if not isinstance(item, list) or not all(isinstance(token, int) for token in item):
            raise EngineRequestError("input_ids must hold integers")
    count = len(batch)
    rid = body.get("rid")
    if is_single:
        if rid is not None and not isinstance(rid, str):
            raise EngineRequestError("rid must be a string for a single request")
        rids = [rid or uuid.uuid4().hex]
    elif rid is None:
        rids = [uuid.uuid4().hex for _ in range(count)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{index}" for index in range(count)]  # as SGLang expands a batch's rid
    else:
        rids = [str(item) for item in _per_item(rid, count, "rid")]
    if len(set(rids)) != len(rids):
        raise EngineRequestError(f"Duplicate request IDs in one batch: {sorted(rids)}")
    params = [
        SamplingParams.from_request(raw)
        for raw in _per_item(body.get("sampling_params"), count, "sampling_params")
    ]
    logprobs = [
        bool(flag) for flag in _per_item(body.get("return_logprob") or False, count, "return_logprob")
    ]
    raw_starts = body.get("logprob_start_len")
    starts = _per_item(-1 if raw_starts is None else raw_starts, count, "logprob_start_len")
    for start in starts:
        # Range checks need the prompt and max_new_tokens: the engine makes them on submit.
        if isinstance(start, bool) or not isinstance(start, int):
            raise EngineRequestError(
                f"logprob_start_len must be an integer (or a list of them), got {start!r}"
            )
    return is_single, [
        GenerateItem(*fields) for fields in zip(rids, batch, params, logprobs, starts, strict=True)
    ]


def build_app(engine: CpuEngine) -> FastAPI:
    """The FastAPI application serving ``engine``; ``app.state.started`` is set once it serves."""
    started = threading.Event()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        started.set()
        yield

    app = FastAPI(title="dynarl CPU engine (SGLang protocol)", lifespan=lifespan)
    app.state.started = started

    @app.exception_handler(EngineRequestError)
    async def refused(_: Request, error: EngineRequestError) -> JSONResponse:
        return _error(str(error))

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(_: Request, error: json.JSONDecodeError) -> JSONResponse:
        return _error(f"the request body is not JSON: {error}")

    async def submit_and_wait(items: list[GenerateItem]) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[dict[str, Any]]] = []
        submitted: list[str] = []

        def resolver(future: asyncio.Future[dict[str, Any]]) -> Callable[[Sequence], None]:
            def settle(result: dict[str, Any]) -> None:
                if not future.done():
                    future.set_result(result)

            def on_done(sequence: Sequence) -> None:
                # Runs on the engine's scheduler thread; the future belongs to the event loop.
                if not loop.is_closed():
                    loop.call_soon_threadsafe(settle, sequence.result or {})

            return on_done

        try:
            for item in items:
                future: asyncio.Future[dict[str, Any]] = loop.create_future()
                engine.submit(
                    item.rid,
                    item.input_ids,
                    item.params,
                    item.return_logprob,
                    on_done=resolver(future),
                    logprob_start_len=item.logprob_start_len,
                )
                futures.append(future)
                submitted.append(item.rid)
        except EngineRequestError:
            # A batch is accepted whole or not at all.
            for rid in submitted:
                await run_in_threadpool(engine.abort, rid)
            raise
        return list(await asyncio.gather(*futures))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            is_single, items = parse_generate_body(await _json_body(request))
        except (TypeError, ValueError) as error:
            return _error(str(error))
        results = await submit_and_wait(items)
        return JSONResponse(results[0] if is_single else results)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        await run_in_threadpool(engine.abort, str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await _json_body(request)
        await run_in_threadpool(engine.pause, str(body.get("mode", "abort")))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await run_in_threadpool(engine.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        success, message = await run_in_threadpool(engine.flush_cache)
        return PlainTextResponse(message + "\n", status_code=200 if success else 400)

    @app.api_route("/slow_down", methods=["GET", "POST"])
    async def slow_down(request: Request) -> Response:
        body = await _json_body(request)
        await run_in_threadpool(engine.slow_down, body.get("forward_sleep_time"))
        return JSONResponse(None)

    def weight_answer(success: bool, message: str, **extra: Any) -> JSONResponse:
        return JSONResponse(
            {"success": success, "message": message, **extra}, status_code=200 if success else 400
        )

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await _json_body(request)
        if not body.get("model_path"):
            return weight_answer(False, "model_path is required", num_paused_requests=0)
        try:
            message = await run_in_threadpool(
                engine.update_weights_from_disk,
                str(body["model_path"]),
                body.get("weight_version"),
                bool(body.get("abort_all_requests", False)),
            )
        except EngineRequestError as error:
            return weight_answer(False, str(error), num_paused_requests=0)
        version = body.get("weight_version")
        if version is not None:
            message += f" Weight version updated to {version}."
        return weight_answer(True, message, num_paused_requests=0)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        body = await _json_body(request)
        try:
            message = await run_in_threadpool(
                engine.init_weights_update_group,
                str(body["master_address"]),
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                str(body.get("group_name") or "weight_update_group"),
                str(body.get("backend") or "nccl"),
            )
        except KeyError as missing:
            return weight_answer(False, f"{missing.args[0]} is required")
        except (EngineRequestError, RuntimeError) as error:
            return weight_answer(False, str(error))
        return weight_answer(True, message)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        body = await _json_body(request)
        try:
            message = await run_in_threadpool(
                engine.destroy_weights_update_group, str(body.get("group_name") or "weight_update_group")
            )
        except EngineRequestError as error:
            return weight_answer(False, str(error))
        return weight_answer(True, message)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        body = await _json_body(request)
        try:
            message = await run_in_threadpool(
                engine.update_weights_from_distributed,
                [str(name) for name in body["names"]],
                [str(dtype) for dtype in body["dtypes"]],
                [[int(size) for size in shape] for shape in body["shapes"]],
                str(body.get("group_name") or "weight_update_group"),
                body.get("weight_version"),
                bool(body.get("abort_all_requests", False)),
            )
        except KeyError as missing:
            return weight_answer(False, f"{missing.args[0]} is required")
        except (EngineRequestError, RuntimeError) as error:
            return weight_answer(False, str(error))
        version = body.get("weight_version")
        if version is not None:
            message += f" Weight version updated to {version}."
        return weight_answer(True, message)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Response:
        body = await _json_body(request)
        await run_in_threadpool(engine.release_memory, body.get("tags"))
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Response:
        body = await _json_body(request)
        await run_in_threadpool(engine.resume_memory, body.get("tags"))
        return JSONResponse(None)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        state = engine.state()
        if not engine.is_alive:
            return Response(status_code=503)
        if state["paused"] is not None or state["num_running_reqs"]:
            return Response(status_code=200)  # it is busy or held on purpose: nothing to prove
        try:
            await asyncio.wait_for(
                submit_and_wait(
                    [
                        GenerateItem(
                            f"HEALTH_CHECK_{time.time()}",
                            [0],
                            SamplingParams(max_new_tokens=1, temperature=0.0),
                        )
                    ]
                ),
                HEALTH_CHECK_TIMEOUT_S,
            )
        except (EngineRequestError, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200)

    def server_info() -> dict[str, Any]:
        state = engine.state()
        return {
            "engine": ENGINE_NAME,
            "version": f"{ENGINE_NAME} (SGLang {PROTOCOL_VERSION} protocol)",
            "model_path": engine.model_path,
            "weight_version": state["weight_version"],
            "max_running_requests": state["max_running_requests"],
            "max_total_num_tokens": state["max_total_num_tokens"],
            "context_length": engine.config.max_positions,
            "skip_tokenizer_init": True,
            "eos_token_id": engine.settings.eos_token_id,
            "model_config": dataclasses.asdict(engine.config),
            "internal_states": [state],
        }

    @app.get("/server_info")
    async def get_server_info() -> Response:
        return JSONResponse(server_info())

    @app.get("/get_server_info")
    async def get_server_info_old_route() -> Response:
        return JSONResponse(server_info())

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return JSONResponse(
            {"model_path": engine.model_path, "is_generation": True, "weight_version": engine.weight_version}
        )

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return JSONResponse({"weight_version": engine.weight_version})

    @app.get("/v1/loads")
    async def loads() -> Response:
        state = engine.state()
        queued = state["num_waiting_reqs"]
        load = {
            "dp_rank": 0,
            "timestamp": time.time(),
            "num_running_reqs": state["num_running_reqs"],
            "num_waiting_reqs": queued,
            "num_used_tokens": state["num_used_tokens"],
            "num_total_tokens": state["num_used_tokens"],
            "max_total_num_tokens": state["max_total_num_tokens"],
            "token_usage": state["num_used_tokens"] / max(1, state["max_total_num_tokens"]),
            "gen_throughput": state["gen_throughput"],
            "cache_hit_rate": state["prefix_hit_tokens"]
            / max(1, state["prefix_hit_tokens"] + state["reprefilled_tokens"]),
            # Here: running requests over the most the engine runs at once.
            "utilization": state["num_running_reqs"] / state["max_running_requests"],
            "max_running_requests": state["max_running_requests"],
            "queues": {
                "waiting": queued,
                "grammar": 0,
                "paused": queued if state["paused"] is not None else 0,
                "retracted": state["num_retracted_reqs"],
            },
            # What only the CPU engine reports, under one clearly named key.
            "cpu_engine": {
                "decode_step_occupancy": state["decode_step_occupancy"],
                "generated_tokens": state["generated_tokens"],
                "decode_steps": state["decode_steps"],
                "prefix_hit_tokens": state["prefix_hit_tokens"],
                "reprefilled_tokens": state["reprefilled_tokens"],
                "prefix_cache_tokens": state["prefix_cache_tokens"],
                "prefix_cache_evicted_blocks": state["prefix_cache_evicted_blocks"],
                "paused": state["paused"],
                "released": state["released"],
                "weight_version": state["weight_version"],
            },
        }
        return JSONResponse(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": server_info()["version"],
                "accelerator": None,
                "num_accelerators": 0,
                "loads": [load],
            }
        )

    @app.get("/get_load")
    async def get_load_old_route() -> Response:
        state = engine.state()
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": state["num_running_reqs"] + state["num_waiting_reqs"],
                    "num_waiting_reqs": state["num_waiting_reqs"],
                    "num_tokens": state["num_used_tokens"],
                }
            ]
        )

    return app


class CpuEngineServer:
    """Serves a :class:`CpuEngine` on 127.0.0.1 from a background thread."""

    def __init__(self, engine: CpuEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self.app = build_app(engine)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))  # port 0: the OS picks a free one, read back below
        self._socket.listen(128)
        self.host, self.port = self._socket.getsockname()[:2]
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=30
            )
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="cpu-engine-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        self._thread.start()
        if not self.app.state.started.wait(timeout_s):
            raise TimeoutError(f"the CPU engine's HTTP server did not start within {timeout_s} s")
        return self.url

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()
        self.engine.shutdown()

    def __enter__(self) -> CpuEngineServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The CPU stand-in for an SGLang server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    parser.add_argument("--config", required=True, help="GPTConfig as JSON")
    parser.add_argument(
        "--model-path",
        default="",
        help="a checkpoint directory (config.json + model.safetensors) to start from",
    )
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--max-running-requests", type=int, default=8)
    parser.add_argument("--prefix-cache-tokens", type=int, default=2048)
    parser.add_argument("--prefix-block-size", type=int, default=4)
    parser.add_argument("--eos-token-id", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    engine = CpuEngine(
        GPTConfig.from_json(args.config),
        EngineSettings(
            max_running_requests=args.max_running_requests,
            prefix_block_size=args.prefix_block_size,
            prefix_cache_tokens=args.prefix_cache_tokens,
            eos_token_id=args.eos_token_id,
            seed=args.seed,
            weight_version=args.weight_version,
        ),
    )
    if args.model_path:
        engine.update_weights_from_disk(args.model_path, weight_version=args.weight_version)
    server = CpuEngineServer(engine, args.host, args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"url": server.start()}), flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
