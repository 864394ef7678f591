"""DataRouter: the per-WorkerGroup request queue of DynaRL's Algorithm 2 (the agentic rollout dispatches
through it, and the simulator models a worker group's queue with it).

Ordering in PRIORITY mode: more completed tool calls first, then a longer KV-cache prefix, then
older first; FIFO mode orders by age only. On top of either order:

- **Affinity**: a follow-up turn of an episode goes to the worker holding its KV cache. Another
  worker may take it only once its worker is gone (a *fallback*), once it has waited longer
  than ``affinity_wait_s`` while that worker is busy, or while the group is out of balance (a
  *steal*): cache reuse against idling.
- **Load balance**: given the workers' loads (requests each is running or holds queued), a worker
  with nothing of its own or shared to take takes a follow-up turn waiting for a worker whose
  load exceeds its own by more than ``balance_abs_threshold`` requests and by the factor
  ``balance_rel_threshold`` (SGLang's cache-aware router switches to the shortest queue on the
  same two thresholds). Without it an engine that joins a group after the episodes were first
  dispatched (GPUs moved to the rollout mid-iteration) would never get work: every later turn
  goes back to the engine holding its cache, which admits it at once.
- **Starvation bound**: a request older than ``max_wait_s`` jumps ahead of everything, oldest
  first, whichever worker asks.
- **Auto-FIFO**: priority ordering pays off only because later turns are shorter; the router
  tracks a moving average of response length per turn index, and while the lengths do not fall
  with the turn index it orders FIFO (switchable with ``auto_fifo``, at construction or later).

Cost: O(log n) per submit and per dispatch (heaps with lazy deletion); a request changes queue
at most once when its affinity expires, once when its worker leaves, and once per mode switch.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# Turn-length moving average: weight of the newest sample once warmed up (a plain mean before),
# and how many samples a turn index needs to take part in the "do turns get shorter?" test.
TURN_LENGTH_ALPHA = 0.1
TURN_LENGTH_MIN_SAMPLES = 8
# Relative shortening per turn needed to turn priority ordering back on (hysteresis).
TURN_SHORTENING_MARGIN = 0.02
# Stale heap items (lazy deletion) are compacted away when they outnumber live requests this much.
COMPACT_FACTOR = 4
COMPACT_SLACK = 1024


class RouterMode(StrEnum):
    PRIORITY = "priority"
    FIFO = "fifo"


@dataclass(frozen=True)
class RoutedRequest:
    request_id: str
    episode_id: str
    completed_tool_calls: int
    prefix_tokens: int
    enqueued_at: float
    payload: Any = None


@dataclass(frozen=True)
class RouterStats:
    dispatched: int
    affinity_hits: int  # dispatched to the worker holding the episode's cache
    affinity_fallbacks: int  # that worker was gone, dispatched elsewhere
    affinity_steals: int  # that worker was alive: the request waited too long, or it was overloaded
    starvation_promotions: int  # dispatched ahead of the order because older than max_wait_s
    mode_now: RouterMode
    queued: int


# Sort keys: heapq pops the smallest.
_Key = tuple[float, ...]


class _Entry:
    """A queued request and where it lives; heap items carry ``version`` for lazy deletion."""

    __slots__ = ("home", "queued", "request", "seq", "version")

    def __init__(self, request: RoutedRequest, seq: int, home: str | None) -> None:
        self.request = request
        self.seq = seq
        self.home = home  # the affinity worker whose queue holds it; None: the shared queue
        self.queued = True
        self.version = 0


_Item = tuple[_Key, int, int, _Entry]  # key, seq (unique tie-break), version, entry


class DataRouter:
    """One group's request queue. Time is whatever clock the caller passes as ``now``."""

    def __init__(
        self,
        *,
        mode: RouterMode = RouterMode.PRIORITY,
        max_wait_s: float = 30.0,
        auto_fifo: bool = True,
        affinity_wait_s: float = 2.0,
        use_affinity: bool = True,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
    ) -> None:
        if max_wait_s < 0 or affinity_wait_s < 0:
            raise ValueError("max_wait_s and affinity_wait_s must not be negative")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError(
                "balance_abs_threshold must not be negative and balance_rel_threshold not below 1"
            )
        self._mode = mode
        self.max_wait_s = max_wait_s
        self._auto_fifo = auto_fifo
        self.affinity_wait_s = affinity_wait_s
        self.use_affinity = use_affinity
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._workers: set[str] = set()
        self._affinity: dict[str, str] = {}  # episode -> worker holding its KV cache
        self._orphaned: set[str] = set()  # episodes whose cache holder left: next dispatch falls back
        self._entries: dict[str, _Entry] = {}  # request id -> queued entry
        self._by_episode: dict[str, set[str]] = {}  # episode -> queued request ids
        self._worker_queues: dict[str, list[_Item]] = {}
        self._queued_for: dict[str, int] = {}  # worker -> requests queued for it by affinity
        self._shared: list[_Item] = []
        self._by_age: list[_Item] = []  # every queued request, oldest first: the starvation bound
        self._affine_by_age: list[_Item] = []  # requests in worker queues, to expire their affinity
        self._seq = 0
        self._turn_length: dict[int, tuple[float, int]] = {}  # turn index -> (moving average, samples)
        self._turns_shorten = True  # no evidence yet: the paper's default
        self._dispatched = 0
        self._hits = 0
        self._fallbacks = 0
        self._steals = 0
        self._promotions = 0

    # -- membership and affinity -----------------------------------------------------------

    def set_workers(self, worker_ids: Iterable[str]) -> None:
        """Set the current members. Affinity to a worker that left is dropped and its queued
        requests go to the shared queue (they will count as fallbacks when dispatched)."""
        self._workers = set(worker_ids)
        for worker_id in [w for w in self._worker_queues if w not in self._workers]:
            for _, _, version, entry in self._worker_queues.pop(worker_id):
                if entry.queued and entry.version == version:
                    self._move(entry, None)
        lost = [e for e, w in self._affinity.items() if w not in self._workers]
        for episode_id in lost:
            del self._affinity[episode_id]
        self._orphaned.update(lost)

    def note_affinity(self, episode_id: str, worker_id: str) -> None:
        """The episode's KV cache now lives on ``worker_id`` (the router also notes this itself
        whenever it dispatches a request)."""
        if not self.use_affinity:
            return
        self._affinity[episode_id] = worker_id
        self._orphaned.discard(episode_id)
        for request_id in self._by_episode.get(episode_id, ()):
            entry = self._entries[request_id]
            self._move(entry, self._home_for(entry.request))

    def forget_episode(self, episode_id: str) -> None:
        """The episode ended: drop its affinity (bounded memory over many iterations)."""
        self._affinity.pop(episode_id, None)
        self._orphaned.discard(episode_id)

    # -- the auto-FIFO detector ------------------------------------------------------------

    def note_turn_length(self, turn_index: int, response_tokens: int) -> None:
        average, samples = self._turn_length.get(turn_index, (0.0, 0))
        samples += 1
        # A plain mean while warming up, so the first samples do not dominate the average.
        weight = max(1.0 / samples, TURN_LENGTH_ALPHA)
        self._turn_length[turn_index] = (average + weight * (response_tokens - average), samples)
        before = self.mode_now
        self._turns_shorten = self._later_turns_shorter()
        if self.mode_now is not before:
            self._rebuild()

    def _later_turns_shorter(self) -> bool:
        """Do response lengths fall with the turn index? The least-squares slope of the average
        length per turn index, relative to the mean length, decides.

        Priority ordering turns off as soon as the slope is not negative, and back on only once
        turns shorten by more than ``TURN_SHORTENING_MARGIN`` per turn: noise around a flat
        profile must not flip the mode (each flip re-keys the queues). Turn indices with too few
        samples are left out; with fewer than two left there is no evidence and nothing changes.
        """
        points = [(t, avg) for t, (avg, n) in self._turn_length.items() if n >= TURN_LENGTH_MIN_SAMPLES]
        if len(points) < 2:
            return self._turns_shorten
        mean_t = sum(t for t, _ in points) / len(points)
        mean_length = sum(length for _, length in points) / len(points)
        spread = sum((t - mean_t) ** 2 for t, _ in points)
        slope = sum((t - mean_t) * (length - mean_length) for t, length in points) / spread
        relative_slope = slope / mean_length if mean_length > 0 else 0.0
        if self._turns_shorten:
            return relative_slope < 0
        return relative_slope < -TURN_SHORTENING_MARGIN

    @property
    def mode_now(self) -> RouterMode:
        if self._mode is RouterMode.FIFO or (self._auto_fifo and not self._turns_shorten):
            return RouterMode.FIFO
        return RouterMode.PRIORITY

    @property
    def mode(self) -> RouterMode:
        """The configured mode; ``mode_now`` is what applies after the auto-FIFO detector."""
        return self._mode

    @mode.setter
    def mode(self, mode: RouterMode) -> None:
        before = self.mode_now
        self._mode = mode
        if self.mode_now is not before:
            self._rebuild()

    @property
    def auto_fifo(self) -> bool:
        return self._auto_fifo

    @auto_fifo.setter
    def auto_fifo(self, enabled: bool) -> None:
        before = self.mode_now
        self._auto_fifo = enabled
        if self.mode_now is not before:
            self._rebuild()

    # -- queueing --------------------------------------------------------------------------

    def submit(self, request: RoutedRequest) -> None:
        """Queue a request; submitting a request id that is already queued is a no-op."""
        if request.request_id in self._entries:
            return
        self._enqueue(request)

    def take_back(self, requests: Iterable[RoutedRequest]) -> None:
        """Re-queue requests taken back from a paused worker, keeping their original age.

        Their episodes lose their affinity: the cache sits on a worker that is going away, and
        the partial output already travels in the request. A request id still queued is replaced
        by the newer version.
        """
        for request in requests:
            if self._affinity.pop(request.episode_id, None) is not None:
                self._orphaned.add(request.episode_id)
            if (old := self._entries.get(request.request_id)) is not None:
                self._remove(old)
            self._enqueue(request)

    def __len__(self) -> int:
        return len(self._entries)

    def next_for_worker(
        self, worker_id: str, now: float, loads: Mapping[str, int] | None = None
    ) -> RoutedRequest | None:
        """The next request for ``worker_id``, or None (also for a worker that is not a member).
        ``loads``: each member's requests running or queued on it now; with them, a worker left
        with nothing may take a follow-up turn from a worker out of balance with it."""
        if worker_id not in self._workers or not self._entries:
            return None
        self._expire_affinity(now)

        oldest = _peek_any(self._by_age)
        if oldest is not None and now - oldest.request.enqueued_at > self.max_wait_s:
            self._promotions += 1
            return self._dispatch(oldest, worker_id)

        own = _peek_home(self._worker_queues.get(worker_id, []), worker_id)
        shared = _peek_home(self._shared, None)
        if own is None and shared is None:
            taken = self._from_overloaded(worker_id, loads) if loads is not None else None
            return None if taken is None else self._dispatch(taken, worker_id)
        if own is None:
            best = shared
        elif shared is None:
            best = own
        else:
            best = own if self._key(own) <= self._key(shared) else shared
        assert best is not None
        return self._dispatch(best, worker_id)

    @property
    def stats(self) -> RouterStats:
        return RouterStats(
            dispatched=self._dispatched,
            affinity_hits=self._hits,
            affinity_fallbacks=self._fallbacks,
            affinity_steals=self._steals,
            starvation_promotions=self._promotions,
            mode_now=self.mode_now,
            queued=len(self._entries),
        )

    # -- internals -------------------------------------------------------------------------

    def _key(self, entry: _Entry) -> _Key:
        request = entry.request
        if self.mode_now is RouterMode.FIFO:
            return (request.enqueued_at,)
        return (-request.completed_tool_calls, -request.prefix_tokens, request.enqueued_at)

    def _from_overloaded(self, worker_id: str, loads: Mapping[str, int]) -> _Entry | None:
        """The best follow-up turn waiting for the most loaded worker out of balance with
        ``worker_id`` (more than ``balance_abs_threshold`` requests and ``balance_rel_threshold``
        times its load), or None. Only workers with turns waiting are weighed: few at a time,
        since a worker with room admits its turns as they come."""
        own = loads.get(worker_id, 0)
        heaviest: tuple[int, str] | None = None
        for home, count in self._queued_for.items():
            load = loads.get(home, 0)
            if (
                count > 0
                and home != worker_id
                and load - own > self.balance_abs_threshold
                and load > self.balance_rel_threshold * own
                and (heaviest is None or load > heaviest[0])
            ):
                heaviest = (load, home)
        if heaviest is None:
            return None
        return _peek_home(self._worker_queues.get(heaviest[1], []), heaviest[1])

    def _home_for(self, request: RoutedRequest) -> str | None:
        worker_id = self._affinity.get(request.episode_id) if self.use_affinity else None
        return worker_id if worker_id in self._workers else None

    def _enqueue(self, request: RoutedRequest) -> None:
        self._seq += 1
        entry = _Entry(request, self._seq, self._home_for(request))
        self._entries[request.request_id] = entry
        self._count_home(entry.home, 1)
        self._by_episode.setdefault(request.episode_id, set()).add(request.request_id)
        heapq.heappush(self._by_age, ((request.enqueued_at,), entry.seq, 0, entry))
        self._push_home(entry)

    def _count_home(self, home: str | None, delta: int) -> None:
        if home is None:
            return
        left = self._queued_for.get(home, 0) + delta
        if left > 0:
            self._queued_for[home] = left
        else:
            self._queued_for.pop(home, None)

    def _push_home(self, entry: _Entry) -> None:
        item: _Item = (self._key(entry), entry.seq, entry.version, entry)
        if entry.home is None:
            heapq.heappush(self._shared, item)
            return
        heapq.heappush(self._worker_queues.setdefault(entry.home, []), item)
        heapq.heappush(self._affine_by_age, ((entry.request.enqueued_at,), entry.seq, entry.version, entry))

    def _move(self, entry: _Entry, home: str | None) -> None:
        if entry.home == home:
            return
        self._count_home(entry.home, -1)
        self._count_home(home, 1)
        entry.home = home
        entry.version += 1  # invalidates the items in the old queue
        self._push_home(entry)

    def _remove(self, entry: _Entry) -> None:
        entry.queued = False
        self._count_home(entry.home, -1)
        del self._entries[entry.request.request_id]
        episode_requests = self._by_episode[entry.request.episode_id]
        episode_requests.discard(entry.request.request_id)
        if not episode_requests:
            del self._by_episode[entry.request.episode_id]

    def _expire_affinity(self, now: float) -> None:
        """Requests that waited past ``affinity_wait_s`` for their busy worker become shared."""
        heap = self._affine_by_age
        while heap:
            (enqueued_at,), _, version, entry = heap[0]
            live = entry.queued and entry.version == version
            if live and now - enqueued_at <= self.affinity_wait_s:
                break
            heapq.heappop(heap)
            if live:
                self._move(entry, None)

    def _dispatch(self, entry: _Entry, worker_id: str) -> RoutedRequest:
        request = entry.request
        self._remove(entry)
        self._dispatched += 1
        holder = self._affinity.get(request.episode_id)
        if holder == worker_id:
            self._hits += 1
        elif holder is not None and holder in self._workers:
            self._steals += 1
        elif holder is not None or request.episode_id in self._orphaned:
            self._fallbacks += 1  # the worker holding the cache is gone
        self._orphaned.discard(request.episode_id)
        if self.use_affinity:
            self._affinity[request.episode_id] = worker_id
        if self._dispatched % COMPACT_SLACK == 0:
            self._maybe_compact()
        return request

    def _maybe_compact(self) -> None:
        """Bound memory: a queue of a worker that stops asking never pops its stale items."""
        items = len(self._shared) + len(self._affine_by_age) + len(self._by_age)
        items += sum(len(q) for q in self._worker_queues.values())
        if items > COMPACT_FACTOR * len(self._entries) + COMPACT_SLACK:
            self._rebuild()

    def _rebuild(self) -> None:
        """Re-key and compact every queue (after a mode switch, or to drop stale items): O(n)."""
        self._shared = []
        self._worker_queues = {}
        self._affine_by_age = []
        self._by_age = [((e.request.enqueued_at,), e.seq, 0, e) for e in self._entries.values()]
        heapq.heapify(self._by_age)
        for entry in self._entries.values():
            entry.version += 1
            self._push_home(entry)


def _peek_any(heap: list[_Item]) -> _Entry | None:
    """The first still-queued entry of ``heap``, dropping dispatched ones on the way."""
    while heap:
        entry = heap[0][3]
        if entry.queued:
            return entry
        heapq.heappop(heap)
    return None


def _peek_home(heap: list[_Item], home: str | None) -> _Entry | None:
    """The best entry that still lives in this queue (``home``), dropping stale items."""
    while heap:
        _, _, version, entry = heap[0]
        if entry.queued and entry.version == version and entry.home == home:
            return entry
        heapq.heappop(heap)
    return None
