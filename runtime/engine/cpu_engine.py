"""CpuEngine: the CPU stand-in for an SGLang server's scheduler, on the plain-torch GPT of model.py.

It is a real engine, small: continuous batching, a prefix KV cache, aborts that return partial
output, the three pause modes, weight updates that carry a version, and memory release/resume.
``cpu_server.py`` puts SGLang's HTTP routes in front of it.

Threads. One scheduler thread owns the model, the KV pool, the prefix cache and every request's
state. Other threads (the HTTP server's) hand it new requests through an inbox and control
operations through a command queue; both are served at the top of each scheduler iteration,
which is the engine's interruption point: *between* decode steps. The lock guards only the
shared views (inbox, queues, counters) and is never held during a forward pass, so readers such
as ``/v1/loads`` never wait for the model.

One iteration:
  1. run queued commands (abort, pause, continue, flush, weight updates, release/resume);
  2. admit waiting requests into free KV slots, up to ``max_running_requests``, copying the
     longest cached prefix of each into its slot;
  3. prefill each newly admitted request (only the tokens the cache did not hold; with every
     position's logits when it asks for input-token log-probs) and sample its next token (none
     for max_new_tokens=0: it finishes there); then one batched decode step over every other
     running request;
  4. record the sampled tokens, finish requests on a stop id, EOS, ``max_new_tokens`` or the
     context limit, and hand finished requests back (their callbacks run on this thread).

Ragged batches: each running request owns one slot of a [slots, heads, max_positions, head_dim]
pool per layer; a decode step gathers the running slots up to the longest length and masks each
request's positions past its own length (see model.py), so raggedness costs padding and a mask,
and a request's KV never moves while it runs.

A request's sequence is prompt + output so far; the pool holds the KV of all of it but the last
sampled token, which is the input of the next decode step. Retracted requests (pause mode
``retract``) and requests resumed elsewhere as prompt + partial output re-enter through the same
prefill, which serves whatever prefix the cache still holds.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from runtime.engine.model import GPT, GPTConfig, KvPool, init_random_gpt
from runtime.engine.prefix_cache import PrefixCache
from runtime.engine.sampling import SamplingParams, sample_token
from runtime.engine.weight_sync import (
    DEFAULT_GROUP_NAME,
    WeightUpdateGroup,
    create_weight_update_group,
    receive_from_trainer,
    release_weight_update_group,
)
from runtime.model.checkpoint import CheckpointError, hf_to_engine_slices, load_checkpoint

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's ServerArgs.weight_version before any update
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache")
METRICS_WINDOW_S = 10.0
T = TypeVar("T")


class EngineRequestError(ValueError):
    """A request or control call the engine refuses (the HTTP layer answers 400 with the message)."""


@dataclass(frozen=True)
class EngineSettings:
    max_running_requests: int = 8
    prefix_block_size: int = 4
    prefix_cache_tokens: int = 2048
    eos_token_id: int | None = None
    seed: int = 0
    model_path: str = ""
    weight_version: str = DEFAULT_WEIGHT_VERSION


@dataclass(eq=False)  # identity semantics: requests are found in queues by identity
class Sequence:
    """One generation request and everything the engine knows about it."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    generator: torch.Generator
    # First prompt position of ``input_token_logprobs`` (SGLang's logprob_start_len, resolved:
    # -1 became len-1, or len for max_new_tokens=0); used only when return_logprob is set.
    logprob_start_len: int = 0
    # Log-probs of prompt tokens logprob_start_len.. (the first always None, as SGLang gives
    # it); None until the prompt's prefill computed them.
    input_logprobs: list[float | None] | None = None
    created_at: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_weight_versions: list[str] = field(default_factory=list)
    slot: int | None = None
    kv_len: int = 0  # positions of tokens() whose KV sits in the slot
    kv_epoch: int = -1  # weight epoch the slot's KV was computed under, -1 if mixed/none
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, over all admissions
    retractions: int = 0
    finish_reason: dict[str, Any] | None = None
    finished_at: float | None = None
    result: dict[str, Any] | None = None
    callbacks: list[Callable[[Sequence], None]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def wants_input_logprobs(self) -> bool:
        """Input log-probs are asked for and not computed yet (a retracted request keeps them)."""
        return self.return_logprob and self.input_logprobs is None

    @property
    def prefill_only(self) -> bool:
        """SGLang's ``max_new_tokens == 0``: a prefill, no token sampled or returned."""
        return self.params.max_new_tokens == 0


@dataclass
class _Command:
    run: Callable[[], Any]
    future: Future[Any]


@dataclass
class EngineCounters:
    generated_tokens: int = 0
    decode_steps: int = 0
    prefills: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    reprefilled_tokens: int = 0  # prompt tokens that had to be prefilled (no cached KV)
    finished_requests: int = 0
    aborted_requests: int = 0
    retracted_requests: int = 0
    weight_updates: int = 0


class CpuEngine:
    """The CPU rollout engine. Start it, submit requests, control it; ``shutdown()`` when done."""

    def __init__(
        self, config: GPTConfig, settings: EngineSettings | None = None, model: GPT | None = None
    ) -> None:
        self.config = config
        self.settings = settings or EngineSettings()
        if self.settings.max_running_requests <= 0:
            raise ValueError("max_running_requests must be positive")
        self._model = model if model is not None else init_random_gpt(config, self.settings.seed)
        self._model.eval()
        self._pool: KvPool | None = KvPool(config, self.settings.max_running_requests)
        self._free_slots = list(range(self.settings.max_running_requests))
        self.prefix_cache = PrefixCache(self.settings.prefix_block_size, self.settings.prefix_cache_tokens)
        self._lock = threading.RLock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: deque[Sequence] = deque()
        self._commands: deque[_Command] = deque()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._live: dict[str, Sequence] = {}
        self._paused: PauseMode | None = None
        self._released: set[str] = set()
        self._weights_backup: Path | None = None
        self._weight_version = self.settings.weight_version
        self._weight_epoch = 0
        self._model_path = self.settings.model_path
        self._groups: dict[str, WeightUpdateGroup] = {}
        self._forward_sleep_s = 0.0
        self._request_counter = 0
        self._stopping = False
        self.counters = EngineCounters()
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._recent_occupancy: deque[tuple[float, float]] = deque()
        self._created_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="cpu-engine-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submission

    def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        return_logprob: bool = False,
        on_done: Callable[[Sequence], None] | None = None,
        logprob_start_len: int = -1,
    ) -> Sequence:
        """Queue one request; ``on_done`` runs on the scheduler thread once it finished.
        ``logprob_start_len`` is SGLang's (see :func:`resolve_logprob_start_len`)."""
        if not input_ids:
            raise EngineRequestError("input_ids cannot be empty")
        out_of_vocab = [token for token in input_ids if not 0 <= token < self.config.vocab_size]
        if out_of_vocab:
            raise EngineRequestError(
                f"input_ids {out_of_vocab[:5]} are outside the vocabulary of {self.config.vocab_size}"
            )
        if len(input_ids) >= self.config.max_positions:
            raise EngineRequestError(
                f"the input ({len(input_ids)} tokens) is longer than the model's context "
                f"({self.config.max_positions} tokens) allows"
            )
        start = resolve_logprob_start_len(
            logprob_start_len, len(input_ids), params.max_new_tokens, return_logprob
        )
        with self._lock:
            if self._stopping:
                raise EngineRequestError("the engine is shutting down")
            if self._released:
                raise EngineRequestError(
                    f"the engine's memory is released ({', '.join(sorted(self._released))}); "
                    "call /resume_memory_occupation before /generate"
                )
            if rid in self._live:
                raise EngineRequestError(f"Duplicate request ID: {rid!r} is already in flight")
            self._request_counter += 1
            seed = params.sampling_seed
            if seed is None:
                seed = self.settings.seed * 1_000_003 + self._request_counter
            sequence = Sequence(
                rid=rid,
                prompt_ids=list(input_ids),
                params=params,
                return_logprob=return_logprob,
                generator=torch.Generator().manual_seed(seed),
                logprob_start_len=start,
            )
            if on_done is not None:
                sequence.callbacks.append(on_done)
            self._live[rid] = sequence
            self._inbox.append(sequence)
            self._wakeup.notify_all()
        return sequence

    def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
        timeout_s: float = 60.0,
        logprob_start_len: int = -1,
    ) -> dict[str, Any]:
        """Submit and wait: the SGLang-shaped result of one request (with log-probs)."""
        with self._lock:
            rid = rid or f"engine-local-{self._request_counter + 1}"
        sequence = self.submit(
            rid, input_ids, params, return_logprob=True, logprob_start_len=logprob_start_len
        )
        if not sequence.done.wait(timeout_s):
            raise TimeoutError(f"request {rid!r} did not finish within {timeout_s} s")
        assert sequence.result is not None
        return sequence.result

    # ------------------------------------------------------------------ control

    def _call(self, run: Callable[[], T], timeout_s: float | None = None) -> T:
        """Run ``run`` on the scheduler thread between two steps and return its result."""
        future: Future[T] = Future()
        with self._lock:
            if self._stopping:
                raise EngineRequestError("the engine is shutting down")
            self._commands.append(_Command(run, future))
            self._wakeup.notify_all()
        return future.result(timeout_s)

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's abort: with ``abort_all`` every request; otherwise ``rid`` must name a request
        in flight, and every request whose rid *starts with* ``rid`` is aborted with it. Aborted
        requests return their partial output. Returns how many were aborted."""

        def run() -> int:
            with self._lock:
                self._drain_inbox()
                if not abort_all and rid not in self._live:
                    return 0
                matched = [seq for seq in self._live.values() if abort_all or seq.rid.startswith(rid)]
                for sequence in matched:
                    self._finish_aborted(sequence, "Aborted by /abort_request")
                return len(matched)

        return self._call(run)

    def pause(self, mode: str) -> None:
        """``abort``: abort every request and hold new ones; ``retract``: take running requests back
        to the waiting queue (their partial output kept, their KV handed to the prefix cache) and
        hold everything; ``in_place``: stop stepping and keep everything as it is."""
        if mode not in PAUSE_MODES:
            raise EngineRequestError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")

        def run() -> None:
            with self._lock:
                self._drain_inbox()
                if mode == "abort":
                    for sequence in list(self._live.values()):
                        self._finish_aborted(sequence, "Aborted by /pause_generation (mode=abort)")
                elif mode == "retract":
                    for sequence in reversed(self._running):
                        self._release_slot(sequence)
                        sequence.retractions += 1
                        self.counters.retracted_requests += 1
                        self._waiting.appendleft(sequence)
                    self._running.clear()
                self._paused = mode  # type: ignore[assignment]

        self._call(run)

    def resume(self) -> None:
        """SGLang's /continue_generation."""

        def run() -> None:
            with self._lock:
                self._paused = None

        self._call(run)

    def flush_cache(self) -> tuple[bool, str]:
        """Drop the prefix cache. Refused while requests run (as SGLang), so paused ``in_place``
        requests keep their cache; after a ``retract`` pause it goes through."""

        def run() -> tuple[bool, str]:
            with self._lock:
                self._drain_inbox()
                if self._running or (self._waiting and self._paused is None):
                    return False, (
                        f"Cache not flushed: {len(self._running)} running and {len(self._waiting)} "
                        "waiting requests"
                    )
                dropped = self.prefix_cache.flush()
                return True, f"Cache flushed ({dropped} blocks)."

        return self._call(run)

    def slow_down(self, forward_sleep_s: float | None) -> None:
        """SGLang's /slow_down: sleep this long after every forward step (for tests)."""

        def run() -> None:
            self._forward_sleep_s = max(0.0, forward_sleep_s or 0.0)

        self._call(run)

    # ------------------------------------------------------------------ weights

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, abort_all_requests: bool = False
    ) -> str:
        """Load a checkpoint directory in the Hugging Face layout SGLang reads (``config.json`` +
        ``model.safetensors``, see runtime/model/checkpoint.py); its model shape must be this
        engine's. Requests in flight continue under the new weights."""

        def run() -> str:
            try:
                config, tensors = load_checkpoint(Path(model_path))
            except CheckpointError as error:
                raise EngineRequestError(str(error)) from error
            if config != self.config:
                raise EngineRequestError(
                    f"{model_path} holds a model of another shape ({config.to_json()}); "
                    f"this engine serves {self.config.to_json()}"
                )
            self._apply_weights(tensors, weight_version, abort_all_requests)
            self._model_path = str(model_path)
            return f"Succeeded to update model weights from {model_path}."

        return self._call(run)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
    ) -> str:
        """Join the trainer's weight-update group as rank ``rank_offset`` (one rank per engine here)."""

        def run() -> str:
            if group_name in self._groups:
                raise EngineRequestError(f"weight update group {group_name!r} already exists")
            try:
                group = create_weight_update_group(
                    master_address, master_port, rank_offset, world_size, group_name, backend
                )
            except ValueError as error:
                raise EngineRequestError(str(error)) from error
            self._groups[group_name] = group
            return f"Joined weight update group {group_name!r} as rank {rank_offset} of {world_size}."

        return self._call(run)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> str:
        def run() -> str:
            group = self._groups.pop(group_name, None)
            if group is None:
                raise EngineRequestError(f"no weight update group named {group_name!r}")
            release_weight_update_group(group)
            return f"Destroyed weight update group {group_name!r}."

        return self._call(run)

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = DEFAULT_GROUP_NAME,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> str:
        """Receive ``names`` (any subset of the parameters) broadcast by rank 0 in that order."""
        if not len(names) == len(dtypes) == len(shapes):
            raise EngineRequestError("names, dtypes and shapes must have the same length")

        def run() -> str:
            group = self._groups.get(group_name)
            if group is None:
                raise EngineRequestError(
                    f"no weight update group named {group_name!r}; call /init_weights_update_group first"
                )
            # Receive everything first: the trainer broadcasts all of it whatever we think of it.
            tensors = receive_from_trainer(group, dtypes, shapes)
            self._apply_weights(dict(zip(names, tensors, strict=True)), weight_version, abort_all_requests)
            return f"Succeeded to update {len(names)} parameters from group {group_name!r}."

        return self._call(run)

    def _apply_weights(
        self, state: dict[str, torch.Tensor], weight_version: str | None, abort_all_requests: bool
    ) -> None:
        """Copy ``state`` (checkpoint names, any subset) into the model, all or nothing."""
        if "weights" in self._released:
            raise EngineRequestError("the weights are released; call /resume_memory_occupation first")
        try:
            slices = hf_to_engine_slices(state, self.config)
        except CheckpointError as error:
            raise EngineRequestError(f"weights refused: {error}") from error
        parameters = dict(self._model.named_parameters())
        checkpoint_names = list(state)
        problems = []
        for checkpoint_name, part in zip(checkpoint_names, slices, strict=True):
            target = parameters[part.name]
            rows = target if part.start is None else target[part.start : part.stop]
            expected = rows.shape
            if tuple(part.tensor.shape) != tuple(expected):
                problems.append(
                    f"{checkpoint_name}: shape {list(part.tensor.shape)}, expected {list(expected)}"
                )
        if problems:
            raise EngineRequestError("weights refused: " + "; ".join(problems[:5]))
        with torch.no_grad():
            for part in slices:
                target = parameters[part.name]
                rows = target if part.start is None else target[part.start : part.stop]
                rows.copy_(part.tensor.to(target.dtype))
        with self._lock:
            if abort_all_requests:
                for sequence in list(self._live.values()):
                    self._finish_aborted(sequence, "Aborted by a weight update")
            self._weight_epoch += 1
            if weight_version is not None:
                self._weight_version = weight_version
            # Cached KV was computed by the old weights.
            self.prefix_cache.flush()
            self.counters.weight_updates += 1

    # ------------------------------------------------------------------ memory

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the KV pool and prefix cache (``kv_cache``) and/or the weights (``weights``: kept
        in a temporary file until resumed). Refused while any request is queued or running."""
        chosen = self._memory_tags(tags)

        def run() -> None:
            with self._lock:
                self._drain_inbox()
                if self._live:
                    raise EngineRequestError(
                        f"cannot release memory with {len(self._live)} requests in flight; "
                        "abort or finish them first (e.g. /pause_generation mode=abort)"
                    )
            if "kv_cache" in chosen and "kv_cache" not in self._released:
                self._pool = None
                self.prefix_cache.flush()
            if "weights" in chosen and "weights" not in self._released:
                handle, name = tempfile.mkstemp(prefix="cpu-engine-weights-", suffix=".pt")
                with open(handle, "wb") as backup:
                    torch.save(self._model.state_dict(), backup)
                self._weights_backup = Path(name)
                with torch.no_grad():
                    for parameter in self._model.parameters():
                        parameter.data = torch.empty(0, dtype=parameter.dtype)
            with self._lock:
                self._released |= set(chosen)

        self._call(run)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        chosen = self._memory_tags(tags)

        def run() -> None:
            if "weights" in chosen and "weights" in self._released:
                assert self._weights_backup is not None
                state = torch.load(self._weights_backup, map_location="cpu", weights_only=True)
                with torch.no_grad():
                    for name, parameter in self._model.named_parameters():
                        parameter.data = state[name]
                self._weights_backup.unlink(missing_ok=True)
                self._weights_backup = None
            if "kv_cache" in chosen and "kv_cache" in self._released:
                self._pool = KvPool(self.config, self.settings.max_running_requests)
                self._free_slots = list(range(self.settings.max_running_requests))
            with self._lock:
                self._released -= set(chosen)
                self._wakeup.notify_all()

        self._call(run)

    @staticmethod
    def _memory_tags(tags: list[str] | None) -> list[str]:
        chosen = list(tags) if tags else list(MEMORY_TAGS)
        unknown = sorted(set(chosen) - set(MEMORY_TAGS))
        if unknown:
            raise EngineRequestError(f"unknown memory tags {unknown}; the CPU engine has {list(MEMORY_TAGS)}")
        return chosen

    # ------------------------------------------------------------------ introspection

    @property
    def weight_version(self) -> str:
        with self._lock:
            return self._weight_version

    @property
    def model(self) -> GPT:
        """The served model (owned by the scheduler thread: read it, do not change it)."""
        return self._model

    @property
    def model_path(self) -> str:
        with self._lock:
            return self._model_path

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def state(self) -> dict[str, Any]:
        """A consistent snapshot of queues, memory state and counters."""
        with self._lock:
            now = time.monotonic()
            self._trim_windows(now)
            window = min(METRICS_WINDOW_S, max(now - self._created_at, 1e-3))
            tokens_per_s = sum(count for _, count in self._recent_tokens) / window
            occupancy = (
                sum(value for _, value in self._recent_occupancy) / len(self._recent_occupancy)
                if self._recent_occupancy
                else 0.0
            )
            used_tokens = sum(sequence.kv_len for sequence in self._running)
            return {
                "num_running_reqs": len(self._running),
                "num_waiting_reqs": len(self._waiting) + len(self._inbox),
                "num_retracted_reqs": sum(1 for sequence in self._waiting if sequence.retractions),
                "max_running_requests": self.settings.max_running_requests,
                "num_used_tokens": used_tokens,
                "max_total_num_tokens": self.settings.max_running_requests * self.config.max_positions,
                "paused": self._paused,
                "released": sorted(self._released),
                "weight_version": self._weight_version,
                "gen_throughput": tokens_per_s,
                "decode_step_occupancy": occupancy,
                "prefix_cache_tokens": self.prefix_cache.cached_tokens,
                "prefix_cache_budget_tokens": self.prefix_cache.token_budget,
                "prefix_cache_evicted_blocks": self.prefix_cache.evicted_blocks,
                **vars(self.counters),
            }

    def generated_tokens(self, rid: str) -> int:
        """Tokens generated so far by a request in flight (0 when unknown)."""
        with self._lock:
            sequence = self._live.get(rid)
            return len(sequence.output_ids) if sequence else 0

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until ``predicate()`` (evaluated under the engine lock after every scheduler
        iteration and command) holds, or the timeout passes; returns the predicate's last value."""
        with self._wakeup:
            return self._wakeup.wait_for(predicate, timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._wakeup.notify_all()
        self._thread.join(timeout_s)
        with self._lock:
            for sequence in list(self._live.values()):
                self._finish_aborted(sequence, "The engine shut down")
            while self._commands:
                self._commands.popleft().future.set_exception(EngineRequestError("the engine shut down"))
        for group in self._groups.values():
            release_weight_update_group(group)
        self._groups.clear()
        if self._weights_backup is not None:
            self._weights_backup.unlink(missing_ok=True)

    # ------------------------------------------------------------------ scheduler thread

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wakeup:
                self._wakeup.wait_for(lambda: self._stopping or bool(self._commands) or self._can_step())
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                try:
                    command.future.set_result(command.run())
                except Exception as error:  # the caller gets it; the engine carries on
                    command.future.set_exception(error)
            try:
                self._step()
            except Exception:
                logger.exception("CPU engine step failed; aborting the running requests")
                with self._lock:
                    for sequence in list(self._running):
                        self._finish_aborted(sequence, "The engine failed while stepping this request")
            with self._wakeup:
                self._wakeup.notify_all()

    def _can_step(self) -> bool:
        if self._inbox:
            return True
        if self._paused is not None or self._released:
            return False
        return bool(self._waiting or self._running)

    def _drain_inbox(self) -> None:
        while self._inbox:
            self._waiting.append(self._inbox.popleft())

    def _step(self) -> None:
        with self._lock:
            self._drain_inbox()
            if self._paused is not None or self._released:
                return
            admitted = self._admit()
            decoding = [sequence for sequence in self._running if sequence not in admitted]
        assert self._pool is not None
        pool = self._pool
        sampled: list[tuple[Sequence, int, float]] = []
        prefilled_only: list[Sequence] = []
        for sequence in admitted:
            tokens = sequence.tokens()
            assert sequence.slot is not None
            if sequence.wants_input_logprobs:
                all_logits = self._model.extend_all_logits(
                    pool, sequence.slot, tokens[sequence.kv_len :], sequence.kv_len
                )
                sequence.input_logprobs = input_token_logprobs(
                    all_logits, sequence.prompt_ids, sequence.kv_len, sequence.logprob_start_len
                )
                logits = all_logits[-1]
            else:
                logits = self._model.extend(pool, sequence.slot, tokens[sequence.kv_len :], sequence.kv_len)
            sequence.kv_len = len(tokens)
            self._cache_sequence(sequence)
            if sequence.prefill_only:
                prefilled_only.append(sequence)
            else:
                sampled.append((sequence, *sample_token(logits, sequence.params, sequence.generator)))
        if decoding:
            logits = self._model.decode(
                pool,
                [_slot_of(sequence) for sequence in decoding],
                [sequence.tokens()[-1] for sequence in decoding],
                [sequence.kv_len for sequence in decoding],
            )
            for row, sequence in enumerate(decoding):
                sequence.kv_len += 1
                sampled.append((sequence, *sample_token(logits[row], sequence.params, sequence.generator)))
        if sampled and self._forward_sleep_s:
            time.sleep(self._forward_sleep_s)
        now = time.monotonic()
        with self._lock:
            for sequence in prefilled_only:
                if sequence.finish_reason is None:  # not aborted while its prefill ran
                    self._finish(sequence, {"type": "length", "length": 0})
            for sequence, token, logprob in sampled:
                self._record_token(sequence, token, logprob)
            self.counters.prefills += len(admitted)
            self.counters.generated_tokens += len(sampled)
            if sampled:
                self._recent_tokens.append((now, len(sampled)))
            if decoding:
                self.counters.decode_steps += 1
                self._recent_occupancy.append((now, len(decoding) / self.settings.max_running_requests))
            self._trim_windows(now)

    def _admit(self) -> list[Sequence]:
        """Move waiting requests into free slots and copy their cached prefix in (lock held)."""
        assert self._pool is not None
        admitted: list[Sequence] = []
        while self._waiting and self._free_slots:
            sequence = self._waiting.popleft()
            sequence.slot = self._free_slots.pop()
            tokens = sequence.tokens()
            # At least the last token must be computed: its logits give the next token.
            usable = len(tokens) - 1
            if sequence.wants_input_logprobs:
                # Input log-probs need the logits of every position from logprob_start_len on,
                # so the cache may serve only the KV before it (SGLang caps its prefix match the
                # same way); the rest is recomputed, attending to the cached KV, which holds the
                # same values a full prefill would write. Keeping per-position log-probs in the
                # cache instead would tie them to its blocks and to one weight version for no
                # gain here: the recomputed span is what the caller asked to be scored.
                usable = min(usable, sequence.logprob_start_len)
            match = self.prefix_cache.match(tokens, max_tokens=usable)
            for index, block_kv in enumerate(match.kv_blocks):
                self._pool.write_span(sequence.slot, index * self.prefix_cache.block_size, block_kv)
            sequence.kv_len = match.tokens
            sequence.kv_epoch = self._weight_epoch
            sequence.cached_tokens += match.tokens
            self.counters.prefix_hit_tokens += match.tokens
            self.counters.reprefilled_tokens += len(tokens) - match.tokens
            self._running.append(sequence)
            admitted.append(sequence)
        return admitted

    def _cache_sequence(self, sequence: Sequence) -> None:
        """Offer the KV a request holds to the prefix cache, if all of it is from today's weights."""
        if sequence.slot is None or self._pool is None or sequence.kv_epoch != self._weight_epoch:
            return
        pool, slot = self._pool, sequence.slot
        self.prefix_cache.insert(
            sequence.tokens()[: sequence.kv_len], lambda start, end: pool.read_span(slot, start, end)
        )

    def _record_token(self, sequence: Sequence, token: int, logprob: float) -> None:
        if sequence.finish_reason is not None:  # aborted while its step ran
            return
        sequence.output_ids.append(token)
        sequence.output_logprobs.append(logprob)
        sequence.output_weight_versions.append(self._weight_version)
        if sequence.kv_epoch != self._weight_epoch:
            sequence.kv_epoch = -1  # the slot now mixes KV of two weight versions
        params = sequence.params
        generated = len(sequence.output_ids)
        may_stop = generated >= params.min_new_tokens
        if (may_stop and token in params.stop_token_ids) or (
            may_stop and not params.ignore_eos and token == self.settings.eos_token_id
        ):
            self._finish(sequence, {"type": "stop", "matched": token})
        elif generated >= params.max_new_tokens or sequence.kv_len + 1 >= self.config.max_positions:
            self._finish(sequence, {"type": "length", "length": generated})

    def _release_slot(self, sequence: Sequence) -> None:
        """Give the request's slot back, handing its KV to the prefix cache first (lock held)."""
        if sequence.slot is None:
            return
        self._cache_sequence(sequence)
        self._free_slots.append(sequence.slot)
        sequence.slot = None
        sequence.kv_len = 0
        sequence.kv_epoch = -1

    def _finish_aborted(self, sequence: Sequence, message: str) -> None:
        self.counters.aborted_requests += 1
        self._finish(sequence, {"type": "abort", "message": message, "status_code": None, "err_type": None})

    def _finish(self, sequence: Sequence, reason: dict[str, Any]) -> None:
        """Take a request out of every queue, build its SGLang-shaped result, notify (lock held)."""
        if sequence.finish_reason is not None:
            return
        sequence.finish_reason = reason
        sequence.finished_at = time.monotonic()
        if sequence in self._running:
            self._running.remove(sequence)
        if sequence in self._waiting:
            self._waiting.remove(sequence)
        if sequence in self._inbox:
            self._inbox.remove(sequence)
        self._release_slot(sequence)
        self._live.pop(sequence.rid, None)
        if reason["type"] != "abort":
            self.counters.finished_requests += 1
        sequence.result = build_generate_result(sequence, self._weight_version)
        sequence.done.set()
        for callback in sequence.callbacks:
            try:
                callback(sequence)
            except Exception:
                logger.exception("completion callback of request %s failed", sequence.rid)
        self._wakeup.notify_all()

    def _trim_windows(self, now: float) -> None:
        for window in (self._recent_tokens, self._recent_occupancy):
            while window and window[0][0] < now - METRICS_WINDOW_S:
                window.popleft()


def _slot_of(sequence: Sequence) -> int:
    assert sequence.slot is not None, f"running request {sequence.rid} has no KV slot"
    return sequence.slot


def weight_version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-token weight versions as SGLang's ``meta_info.weight_versions``: runs of one version,
    ``{"version", "start", "end"}`` over output-token indices [start, end)."""
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": version, "start": index, "end": index + 1})
    return spans


def resolve_logprob_start_len(
    requested: int, prompt_len: int, max_new_tokens: int, return_logprob: bool
) -> int:
    """SGLang's reading of ``logprob_start_len`` (scheduler.handle_generate_request): -1 (the
    default) or no return_logprob means only the last prompt token (len-1, whose row is None),
    or no prompt token at all (len) for a prefill-only request (max_new_tokens=0). Otherwise it
    must lie inside the prompt, except that a prefill-only request may start at or past its end
    (no input rows). Values below -1 are refused here (SGLang does not check them)."""
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise EngineRequestError(f"logprob_start_len must be an integer, got {requested!r}")
    if requested < -1:
        raise EngineRequestError(f"logprob_start_len must be -1 or a prompt position >= 0, got {requested}")
    prefill_only = max_new_tokens == 0
    if requested == -1 or not return_logprob:
        return prompt_len if prefill_only else prompt_len - 1
    if requested >= prompt_len and not prefill_only:
        raise EngineRequestError(
            f"logprob_start_len={requested} is higher than the number of input tokens "
            f"({prompt_len}); use a smaller logprob_start_len"
        )
    return min(requested, prompt_len)


def input_token_logprobs(
    logits: torch.Tensor, tokens: list[int], first_position: int, start: int
) -> list[float | None]:
    """Log-probs of ``tokens[start:]`` shaped as SGLang's ``input_token_logprobs`` values: the
    first is None (SGLang always pads the row at logprob_start_len, even when start > 0), then
    log p(tokens[j] | tokens[:j]) for j > start. ``logits`` are those of positions
    first_position.. (row i predicts the token after position first_position+i); the caller
    made sure first_position <= start."""
    if start >= len(tokens):
        return []
    assert first_position <= start, "the prefix cache served positions whose log-probs are asked for"
    targets = torch.tensor(tokens[start + 1 :], dtype=torch.long)
    rows = logits[start - first_position : len(tokens) - 1 - first_position].float()
    picked = torch.log_softmax(rows, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    values: list[float | None] = [None]
    values.extend(float(value) for value in picked.tolist())
    return values


def build_generate_result(sequence: Sequence, current_version: str) -> dict[str, Any]:
    """One ``/generate`` answer shaped as SGLang shapes it for token-id input (no text: the CPU
    engine has no tokenizer)."""
    spans = weight_version_spans(sequence.output_weight_versions)
    finished_at = sequence.finished_at or time.monotonic()
    meta_info: dict[str, Any] = {
        "id": sequence.rid,
        "finish_reason": sequence.finish_reason,
        "prompt_tokens": len(sequence.prompt_ids),
        "completion_tokens": len(sequence.output_ids),
        "cached_tokens": sequence.cached_tokens,
        "weight_version": spans[-1]["version"] if spans else current_version,
        "weight_versions": spans or [{"version": current_version, "start": 0, "end": 0}],
        "retraction_count": sequence.retractions,
        "e2e_latency": finished_at - sequence.created_at,
    }
    if sequence.return_logprob:
        # Empty when the request ended (aborted) before its prompt was prefilled.
        meta_info["input_token_logprobs"] = [
            [logprob, token, None]
            for logprob, token in zip(
                sequence.input_logprobs or [],
                sequence.prompt_ids[sequence.logprob_start_len :],
                strict=False,
            )
        ]
        meta_info["output_token_logprobs"] = [
            [logprob, token, None]
            for logprob, token in zip(sequence.output_logprobs, sequence.output_ids, strict=True)
        ]
    return {"output_ids": list(sequence.output_ids), "meta_info": meta_info}
