"""One inference engine (an SGLang-like server on ``tp`` GPUs), advanced a whole batch at a time.

Continuous batching: every decode step advances each running request by one token. Between two
structural changes (an admission, a completion, a retraction, a pause) the batch ``B`` is fixed and
its total context grows by ``B`` per step, so the time of ``k`` steps has a closed form and the
simulator only wakes the engine at its next completion (or when its KV pool would overflow),
never per token.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque

from scheduler.core.hypergraph import Device
from scheduler.core.sim.perf import EngineCoeffs


class SimRequest:
    """One turn of one episode, as an engine sees it."""

    __slots__ = (
        "completed_tool_calls",
        "context",
        "enqueued_at",
        "episode",
        "fresh",
        "generated",
        "max_new",
        "remaining",
        "rid",
        "start_step",
        "turn",
        "version",
    )

    def __init__(
        self,
        rid: int,
        episode: int,
        turn: int,
        context: int,
        remaining: int,
        max_new: int,
        enqueued_at: float,
        completed_tool_calls: int = 0,
    ) -> None:
        self.rid = rid
        self.episode = episode
        self.turn = turn
        self.context = context  # KV tokens once prefilled: prompt, earlier turns, output so far
        self.remaining = remaining  # tokens still to generate this turn (known to the trace only)
        self.max_new = max_new  # what the engine may still generate this turn (it plans with this)
        self.generated = 0  # tokens generated this turn before the current admission
        self.start_step = 0  # the engine step at admission
        self.version = -1  # policy version of the weights that started the episode
        self.enqueued_at = enqueued_at
        self.completed_tool_calls = completed_tool_calls
        self.fresh = context  # trailing context tokens no engine has prefilled yet


class Engine:
    def __init__(
        self,
        worker_id: str,
        devices: tuple[Device, ...],
        coeffs: EngineCoeffs,
        *,
        max_running: int,
        peak_tokens_per_s: float,
        kv_reserve_ratio: float,
        now: float,
        retract_to_fraction: float = 0.9,
    ) -> None:
        self.worker_id = worker_id
        self.devices = devices
        self.coeffs = coeffs
        self.max_running = max_running
        self.capacity = coeffs.kv_capacity_tokens
        self.peak_tokens_per_s = peak_tokens_per_s
        self.kv_reserve_ratio = kv_reserve_ratio
        self.retract_to_fraction = retract_to_fraction
        self.epoch = 0  # bumped on every reschedule; stale heap entries carry an old epoch

        self.steps = 0
        self.origin = now  # decode resumes from ``steps`` at this time (later than now while paused)
        self.running: dict[int, SimRequest] = {}
        self._finish: list[tuple[int, int]] = []  # (finish step, request id)
        self._ctx_base = 0  # sum(context_i - start_step_i): total context = _ctx_base + B * steps
        self._start_sum = 0
        self._max_new_sum = 0
        self.local: deque[SimRequest] = deque()  # dispatched here, not yet admitted (or retracted)
        self.cache: OrderedDict[int, int] = OrderedDict()  # episode -> cached KV tokens (radix cache)
        self.cache_tokens = 0

        self.decoded_tokens = 0  # committed
        self._prefill_done_s = 0.0
        self._prefill_start = now
        self._prefill_end = now
        self.retractions = 0
        self._pending_prefill_flops = 0.0
        self.prefilled_tokens = 0
        self.reprefilled_tokens = 0

    # -- state -----------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return len(self.running)

    def context(self, steps: int | None = None) -> int:
        return self._ctx_base + self.batch * (self.steps if steps is None else steps)

    def steps_for(self, elapsed: float) -> int:
        """Whole decode steps the current batch completes in ``elapsed`` seconds from ``origin``."""
        batch = self.batch
        if batch == 0 or elapsed <= 0:
            return 0
        c = self.coeffs
        context0 = self.context()
        compute_step = c.fixed_s + c.per_sequence_s * batch
        gap = c.per_sequence_s * batch - c.weights_s - c.per_context_token_s * context0
        compute_bound = max(0, math.ceil(gap / (c.per_context_token_s * batch))) if gap > 0 else 0
        if compute_bound and elapsed < compute_bound * compute_step:
            n = int(elapsed // compute_step)
        else:
            rest = elapsed - compute_bound * compute_step
            a = c.per_context_token_s * batch / 2.0
            b = c.fixed_s + c.weights_s + c.per_context_token_s * (context0 + batch * compute_bound) - a
            j = (-b + math.sqrt(b * b + 4.0 * a * rest)) / (2.0 * a) if a > 0 else rest / b
            n = compute_bound + max(0, int(j))
        # Float rounding can be off by one either way; settle it against the exact sum.
        tolerance = 1e-9
        while self.time_for(n + 1) <= elapsed + tolerance:
            n += 1
        while n > 0 and self.time_for(n) > elapsed + tolerance:
            n -= 1
        return n

    def time_for(self, n: int) -> float:
        """Seconds for ``n`` decode steps of the current batch from ``origin``."""
        batch = self.batch
        if n <= 0 or batch == 0:
            return 0.0
        c = self.coeffs
        context0 = self.context()
        compute_step = c.fixed_s + c.per_sequence_s * batch
        gap = c.per_sequence_s * batch - c.weights_s - c.per_context_token_s * context0
        compute_bound = max(0, math.ceil(gap / (c.per_context_token_s * batch))) if gap > 0 else 0
        n1 = min(n, compute_bound)
        memory_steps = n - n1
        first = c.fixed_s + c.weights_s + c.per_context_token_s * context0
        index_sum = n * (n - 1) / 2.0 - n1 * (n1 - 1) / 2.0
        return n1 * compute_step + memory_steps * first + c.per_context_token_s * batch * index_sum

    def next_event(self) -> tuple[float, int] | None:
        """(time, step) of the next completion or KV overflow; None when idle."""
        if not self.running:
            return None
        step = self._finish[0][0]
        batch = self.batch
        if batch > 1:
            # A lone request always fits (the pool is checked against the longest context).
            overflow = (self.capacity - self._ctx_base) // batch + 1
            step = min(step, max(overflow, self.steps))
        return self.origin + self.time_for(step - self.steps), step

    # -- time ------------------------------------------------------------------------------

    def commit(self, now: float) -> None:
        """Bring the engine to ``now``; a partly done step is dropped (new work joins at a step)."""
        if now <= self.origin:
            return
        n = self.steps_for(now - self.origin)
        self.decoded_tokens += n * self.batch
        self.steps += n
        self.origin = now
        self._evict()

    def advance_to_step(self, step: int) -> None:
        n = step - self.steps
        if n <= 0:
            return
        self.origin += self.time_for(n)
        self.decoded_tokens += n * self.batch
        self.steps = step

    def pause(self, now: float, seconds: float) -> None:
        """Stop decoding for ``seconds`` (weight update): nothing progresses, nothing is lost."""
        self.commit(now)
        self.origin = max(self.origin, now) + seconds
        self.epoch += 1

    # -- requests --------------------------------------------------------------------------

    def peek_steps(self, now: float) -> int:
        """Decode steps done by ``now`` without committing them."""
        if now <= self.origin:
            return self.steps
        return self.steps + self.steps_for(now - self.origin)

    def reserved_tokens(self, steps: int) -> float:
        """KV the running batch is expected to still need (SGLang's new_token_ratio estimate)."""
        generated_since_admission = self.batch * steps - self._start_sum
        return self.kv_reserve_ratio * max(0, self._max_new_sum - generated_since_admission)

    def fits(self, request: SimRequest, now: float) -> bool:
        """Whether admitting ``request`` at ``now`` keeps the expected KV within the pool."""
        if self.batch >= self.max_running:
            return False
        if self.batch == 0:
            return True  # a lone request always fits (the pool is checked against the longest context)
        steps = self.peek_steps(now)
        need = request.context + self.kv_reserve_ratio * request.max_new
        return self.context(steps) + self.reserved_tokens(steps) + need <= self.capacity

    def add(self, request: SimRequest, now: float) -> None:
        """Admit ``request`` at ``now``; its prefill (a cache hit skips the cached prefix) runs
        when ``flush`` is called, batched with the other admissions of the same instant."""
        self.commit(now)
        cached = self.cache.pop(request.episode, 0)
        if cached:
            self.cache_tokens -= cached
            cached = min(cached, request.context)
        new_tokens = request.context - cached
        self._pending_prefill_flops += self.coeffs.prefill_flops(new_tokens, cached)
        self.prefilled_tokens += new_tokens
        self.reprefilled_tokens += max(0, new_tokens - request.fresh)
        request.fresh = 0
        request.start_step = self.steps
        self.running[request.rid] = request
        heapq.heappush(self._finish, (self.steps + request.remaining, request.rid))
        self._ctx_base += request.context - self.steps
        self._start_sum += self.steps
        self._max_new_sum += request.max_new

    def flush(self, now: float) -> None:
        """Run the prefill of the admissions since the last flush: decode stops meanwhile."""
        seconds = self.coeffs.prefill_s(self._pending_prefill_flops)
        self._pending_prefill_flops = 0.0
        if seconds > 0:
            start = max(self.origin, now)
            if start > self._prefill_end:
                self._prefill_done_s += self._prefill_end - self._prefill_start
                self._prefill_start = start
            self._prefill_end = start + seconds
            self.origin = start + seconds
        self._evict()
        self.epoch += 1

    def _remove(self, request: SimRequest) -> None:
        del self.running[request.rid]
        tokens_now = request.context + (self.steps - request.start_step)
        self._ctx_base -= request.context - request.start_step
        self._start_sum -= request.start_step
        self._max_new_sum -= request.max_new
        produced = self.steps - request.start_step
        request.generated += produced
        request.remaining -= produced
        request.max_new -= produced
        request.context = tokens_now

    def _prune_finish(self) -> None:
        """Drop the completion entries of requests no longer running here."""
        self._finish = [(s, rid) for s, rid in self._finish if rid in self.running]
        heapq.heapify(self._finish)

    def pop_finished(self) -> list[SimRequest]:
        """Requests whose last token was produced by the current step, in id order."""
        done: list[SimRequest] = []
        while self._finish and self._finish[0][0] <= self.steps:
            _, rid = heapq.heappop(self._finish)
            request = self.running.get(rid)
            if request is None:
                continue
            self._remove(request)
            done.append(request)
        if done:
            self.epoch += 1
        return done

    def retract_if_full(self) -> list[SimRequest]:
        """When the running batch outgrows the KV pool, retract the youngest requests (fewest
        generated tokens, as SGLang does) to the front of the local queue; they re-prefill later."""
        if self.context() <= self.capacity:
            return []
        target = self.capacity * self.retract_to_fraction
        victims = sorted(
            self.running.values(),
            key=lambda r: (r.generated + self.steps - r.start_step, -r.context, -r.rid),
        )
        retracted: list[SimRequest] = []
        for victim in victims:
            if self.context() <= target or self.batch <= 1:
                break
            self._remove(victim)
            retracted.append(victim)
        self._prune_finish()
        self.local.extendleft(reversed(retracted))
        self.retractions += len(retracted)
        self.epoch += 1
        return retracted

    def take_queued(self, count: int) -> list[SimRequest]:
        """Up to ``count`` requests dispatched here and not yet admitted, the last queued first
        (those at the head would be admitted soonest)."""
        taken: list[SimRequest] = []
        while self.local and len(taken) < count:
            taken.append(self.local.pop())
        return taken

    def shed(self, now: float, count: int) -> tuple[list[SimRequest], list[SimRequest]]:
        """Abort ``count`` running requests for a growing rollout's new engines, those that
        have generated least first (the latest begun: the least output to prefill again there).
        Returns (requests that just finished, requests shed with their progress kept as context)."""
        self.commit(now)
        finished = self.pop_finished()
        if count <= 0 or not self.running:
            return finished, []
        victims = sorted(
            self.running.values(),
            key=lambda r: (r.generated + self.steps - r.start_step, -r.rid),
        )[:count]
        for victim in victims:
            self._remove(victim)
        self._prune_finish()
        self.epoch += 1
        return finished, victims

    def take_back_all(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Stop the engine: (requests that just finished, every other running or locally queued
        request with its progress kept as context)."""
        self.commit(now)
        finished = self.pop_finished()
        taken = list(self.running.values())
        for request in taken:
            self._remove(request)
        self._finish.clear()
        taken.extend(self.local)
        self.local.clear()
        self.cache.clear()
        self.cache_tokens = 0
        self.epoch += 1
        return finished, taken

    def cache_episode(self, episode: int, tokens: int) -> None:
        """Keep a finished turn's KV (radix cache) until memory pressure evicts it, oldest first."""
        previous = self.cache.pop(episode, 0)
        self.cache_tokens += tokens - previous
        self.cache[episode] = tokens
        self._evict()

    def _evict(self) -> None:
        room = self.capacity - self.context()
        while self.cache and self.cache_tokens > room:
            _, tokens = self.cache.popitem(last=False)
            self.cache_tokens -= tokens

    # -- telemetry -------------------------------------------------------------------------

    def decoded_at(self, now: float) -> int:
        """Decode tokens produced up to ``now`` (without committing)."""
        if now <= self.origin:
            return self.decoded_tokens
        return self.decoded_tokens + self.batch * self.steps_for(now - self.origin)

    def prefill_busy_at(self, now: float) -> float:
        current = min(max(now - self._prefill_start, 0.0), self._prefill_end - self._prefill_start)
        return self._prefill_done_s + current
