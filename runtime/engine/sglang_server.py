"""Start a real SGLang server for a rollout or inference worker, where SGLang and CUDA are present.

The worker then drives it through the same ``EngineClient`` as the CPU stand-in: the routes and
fields are SGLang's own. The model is the job's checkpoint directory (runtime/model/checkpoint.py
writes it in the Hugging Face layout SGLang loads), and the tokenizer is ours, so SGLang runs with
``--skip-tokenizer-init`` and takes ``input_ids`` only, as the RL loop sends them.

``unavailable_reason`` says why SGLang cannot run here (not installed, no CUDA device); a worker
configured for ``auto`` then runs the CPU stand-in and reports that reason, one configured for
``sglang`` fails with it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx
import torch

from runtime.engine.client import EngineClient, EngineError

log = logging.getLogger(__name__)

ENGINE_CHOICES: Final = ("auto", "sglang", "cpu")
STARTUP_TIMEOUT_S: Final = 600.0
STOP_TIMEOUT_S: Final = 30.0
_POLL_S: Final = 1.0
_LOG_TAIL_CHARS: Final = 4000


_PR_SET_PDEATHSIG: Final = 1


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the worker that started it dies
    (a killed Ray actor runs no cleanup of its own), so no server outlives its worker."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _counter(metrics: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (all label sets) in ``metrics`` text."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


class SGLangUnavailable(RuntimeError):
    """SGLang cannot be started here, or it exited before it served."""


def unavailable_reason() -> str | None:
    """Why a real SGLang server cannot run in this process's environment; None when it can."""
    if importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed in this Python environment"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"no CUDA device is available (CUDA_VISIBLE_DEVICES={visible!r})"
    return None


def choose_engine(requested: str) -> tuple[str, str]:
    """``(engine, note)`` for a worker asked for ``requested`` (one of ENGINE_CHOICES): "sglang"
    or "cpu", and why the CPU stand-in was chosen ("" when it was asked for or SGLang runs)."""
    if requested not in ENGINE_CHOICES:
        raise ValueError(f"engine must be one of {', '.join(ENGINE_CHOICES)}, not {requested!r}")
    if requested == "cpu":
        return "cpu", ""
    reason = unavailable_reason()
    if reason is None:
        return "sglang", ""
    if requested == "sglang":
        raise SGLangUnavailable(f"the job asks for SGLang engines, but {reason}")
    return "cpu", f"CPU stand-in for SGLang: {reason}"


@dataclass
class SGLangServer:
    """One ``python -m sglang.launch_server`` process serving ``model_path``."""

    model_path: Path
    host: str
    port: int
    max_running_requests: int = 8
    mem_fraction_static: float = 0.5
    weight_version: str = "default"
    seed: int = 0
    extra_args: Sequence[str] = ()
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log_path: Path | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tp-size",
            "1",
            # Our tokenizer is a character table in the repository: the RL loop sends input_ids.
            "--skip-tokenizer-init",
            "--max-running-requests",
            str(self.max_running_requests),
            "--mem-fraction-static",
            str(self.mem_fraction_static),
            "--weight-version",
            self.weight_version,
            "--random-seed",
            str(self.seed),
            # /release_memory_occupation and /resume_memory_occupation need it.
            "--enable-memory-saver",
            # Prometheus counters on /metrics: the worker's generated tokens and finished requests.
            "--enable-metrics",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """Start the server and return its URL once ``/health`` answers; an exit before that is
        an error carrying the end of the server's log."""
        handle, name = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log")
        self._log_path = Path(name)
        with os.fdopen(handle, "wb") as log_file:
            self._process = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        log.info("started SGLang (pid %s) on %s: %s", self._process.pid, self.url, " ".join(self.command()))
        client = EngineClient(self.url, timeout_s=5.0)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise SGLangUnavailable(
                        f"SGLang exited with status {self._process.returncode} before serving: {self.log_tail()}"
                    )
                try:
                    if client.health():
                        return self.url
                except EngineError:
                    pass
                time.sleep(_POLL_S)
        finally:
            client.close()
        self.stop()
        raise SGLangUnavailable(f"SGLang did not serve within {timeout_s:.0f} s: {self.log_tail()}")

    def counters(self) -> tuple[int, int]:
        """``(generated tokens, finished requests)`` so far, from SGLang's Prometheus counters
        (``sglang:generation_tokens_total``, ``sglang:num_requests_total``); zeros while the
        server has not answered."""
        try:
            text = httpx.get(self.url + "/metrics", timeout=2.0).text
        except httpx.HTTPError:
            return 0, 0
        return int(_counter(text, "sglang:generation_tokens_total")), int(
            _counter(text, "sglang:num_requests_total")
        )

    def log_tail(self) -> str:
        if self._log_path is None or not self._log_path.is_file():
            return ""
        return self._log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)
