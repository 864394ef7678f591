"""Sliding-window aggregation of worker telemetry into per-group signals.

Agents (or the simulator) report one :class:`WorkerSample` per worker per period; the scheduling
tick asks for :class:`GroupSignals` once a second. Memory is bounded: a worker keeps only the
samples of the last window, and workers that stop reporting are swept out after a window.

Definitions (all over the window ``(now - window_s, now]``):

- ``utilisation_mean`` / ``_p50`` / ``_p90`` / ``_p99``: over **all samples** of the group's
  workers in the window (not the latest sample per worker), so a worker that reports more often
  weighs more; quantiles interpolate linearly between order statistics.
- ``low_utilisation_workers``: workers whose samples cover (nearly) the whole window and are all
  strictly under ``u_low``, lowest mean utilisation first. "Cover" means the worker's first
  sample in the window is at or before ``now - window_s + tolerance``, the tolerance being one
  and a half sample periods (one period, plus half a period for reporting jitter); a worker that
  started inside the window therefore never counts as idle for the window.
- ``low_utilisation_fraction``: those workers / the group's workers.
- ``queue_length`` and ``in_flight``: sums of each worker's latest sample.
- ``tokens_per_s``: tokens reported in the window / the span they cover. A sample's tokens were
  produced since the worker's previous sample, so the span reaches one period before the
  earliest sample, capped at the window.
- ``progress``: the highest progress any worker reported in its latest sample carrying one.
- ``busy``: some worker's latest sample shows utilisation, queued or in-flight work.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice

from scheduler.core.hypergraph import Hypergraph
from scheduler.core.signals import GroupSignals, WorkerSample

# A sample period plus half a period of reporting jitter.
COVERAGE_TOLERANCE_PERIODS = 1.5


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values (numpy's default method)."""
    if not sorted_values:
        return 0.0
    position = q * (len(sorted_values) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    fraction = position - lower
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * fraction


class _WorkerWindow:
    """One worker's samples in time order, with their times, utilisations and tokens kept in
    parallel deques so the per-tick folds (sum, max, extend) run at C speed."""

    __slots__ = ("group_id", "samples", "times", "tokens", "utilisations")

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.samples: deque[WorkerSample] = deque()
        self.times: deque[float] = deque()
        self.utilisations: deque[float] = deque()
        self.tokens: deque[int] = deque()

    def put(self, sample: WorkerSample) -> None:
        times = self.times
        if not times or sample.at > times[-1]:
            self.samples.append(sample)
            times.append(sample.at)
            self.utilisations.append(sample.utilisation)
            self.tokens.append(sample.tokens)
            return
        # Out of order or repeated delivery: a sample with the same timestamp replaces the
        # stored one, so a retransmitted report is not counted twice.
        position = bisect_left(times, sample.at)
        if position < len(times) and times[position] == sample.at:
            self.samples[position] = sample
            self.utilisations[position] = sample.utilisation
            self.tokens[position] = sample.tokens
            return
        self.samples.insert(position, sample)
        times.insert(position, sample.at)
        self.utilisations.insert(position, sample.utilisation)
        self.tokens.insert(position, sample.tokens)

    def drop_before(self, horizon: float) -> None:
        """Drop samples at or before ``horizon``: the window is open on the left."""
        times = self.times
        while times and times[0] <= horizon:
            times.popleft()
            self.samples.popleft()
            self.utilisations.popleft()
            self.tokens.popleft()


class SignalAggregator:
    """Keeps each worker's samples of the last ``window_s`` and folds them into GroupSignals."""

    def __init__(self, *, window_s: float = 10.0, u_low: float = 0.2, sample_period_s: float = 1.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        if sample_period_s <= 0:
            raise ValueError("sample_period_s must be positive")
        self.window_s = window_s
        self.u_low = u_low
        self.sample_period_s = sample_period_s
        self._workers: dict[str, _WorkerWindow] = {}
        self._groups: dict[str, set[str]] = {}
        self._latest_at = -math.inf
        self._next_sweep_at = -math.inf

    # -- ingestion -------------------------------------------------------------------------

    def add(self, sample: WorkerSample) -> None:
        window = self._workers.get(sample.worker_id)
        if window is None or window.group_id != sample.group_id:
            # Worker ids are unique within a job; a new group for the same id means the old
            # samples describe another role and must not leak into the new group's signals.
            self.forget_worker(sample.worker_id)
            window = _WorkerWindow(sample.group_id)
            self._workers[sample.worker_id] = window
            self._groups.setdefault(sample.group_id, set()).add(sample.worker_id)
        window.put(sample)
        window.drop_before(window.times[-1] - self.window_s)
        if sample.at > self._latest_at:
            self._latest_at = sample.at
            if sample.at >= self._next_sweep_at:
                self._sweep(sample.at)

    def add_many(self, samples: Iterable[WorkerSample]) -> None:
        for sample in samples:
            self.add(sample)

    def forget_worker(self, worker_id: str) -> None:
        window = self._workers.pop(worker_id, None)
        if window is None:
            return
        members = self._groups.get(window.group_id)
        if members is not None:
            members.discard(worker_id)
            if not members:
                del self._groups[window.group_id]

    def _sweep(self, now: float) -> None:
        """Drop workers silent for a whole window; runs at most once per window of sample time."""
        horizon = now - self.window_s
        stale = [w for w, window in self._workers.items() if not window.times or window.times[-1] <= horizon]
        for worker_id in stale:
            self.forget_worker(worker_id)
        self._next_sweep_at = now + self.window_s

    # -- queries ---------------------------------------------------------------------------

    def group_signals(
        self,
        group_id: str,
        now: float,
        *,
        worker_ids: Sequence[str] | None = None,
        max_in_flight_per_worker: int = 0,
    ) -> GroupSignals:
        """Signals of one group at ``now``.

        ``worker_ids`` are the group's current members: samples of any other worker are ignored
        and a member without samples still counts in ``workers``. Without it, the members are the
        workers that reported for this group.
        """
        members = list(worker_ids) if worker_ids is not None else sorted(self._groups.get(group_id, ()))
        horizon = now - self.window_s
        utilisations: list[float] = []
        low: list[tuple[float, str]] = []
        queue_length = 0
        in_flight = 0
        tokens = 0
        earliest = math.inf
        progress: float | None = None
        busy = False

        for worker_id in members:
            window = self._workers.get(worker_id)
            if window is None or window.group_id != group_id:
                continue
            window.drop_before(horizon)
            times = window.times
            if not times:
                continue
            samples: Sequence[WorkerSample]
            worker_utilisations: Sequence[float]
            if times[-1] <= now:
                count = len(times)
                samples, worker_utilisations = window.samples, window.utilisations
                tokens += sum(window.tokens)
            else:
                # Asked about the past: later samples stay stored but do not count.
                count = bisect_right(times, now)
                if not count:
                    continue
                samples = list(islice(window.samples, count))
                worker_utilisations = list(islice(window.utilisations, count))
                tokens += sum(islice(window.tokens, count))
            first_at = times[0]
            earliest = min(earliest, first_at)
            utilisations.extend(worker_utilisations)
            latest = samples[-1]
            queue_length += latest.queue_length
            in_flight += latest.in_flight
            busy = busy or latest.utilisation > 0 or latest.queue_length > 0 or latest.in_flight > 0
            for sample in reversed(samples):
                if sample.progress is not None:
                    progress = sample.progress if progress is None else max(progress, sample.progress)
                    break
            if max(worker_utilisations) < self.u_low and first_at <= horizon + self._tolerance(
                first_at, latest.at, count
            ):
                low.append((sum(worker_utilisations) / count, worker_id))

        workers = len(members)
        if not utilisations:
            return GroupSignals(
                group_id=group_id,
                at=now,
                window_s=self.window_s,
                workers=workers,
                max_in_flight_per_worker=max_in_flight_per_worker,
                busy=False,
            )
        utilisations.sort()
        low.sort()
        span = min(self.window_s, now - earliest + self.sample_period_s)
        return GroupSignals(
            group_id=group_id,
            at=now,
            window_s=self.window_s,
            workers=workers,
            utilisation_mean=sum(utilisations) / len(utilisations),
            utilisation_p50=quantile(utilisations, 0.5),
            utilisation_p90=quantile(utilisations, 0.9),
            utilisation_p99=quantile(utilisations, 0.99),
            low_utilisation_fraction=len(low) / workers if workers else 0.0,
            low_utilisation_workers=tuple(worker_id for _, worker_id in low),
            queue_length=queue_length,
            in_flight=in_flight,
            max_in_flight_per_worker=max_in_flight_per_worker,
            tokens_per_s=tokens / span if span > 0 else 0.0,
            progress=progress if progress is not None else 0.0,
            busy=busy,
        )

    def all_signals(
        self,
        graph: Hypergraph,
        now: float,
        *,
        max_in_flight_per_worker: Mapping[str, int] | None = None,
    ) -> dict[str, GroupSignals]:
        """Signals of every group in ``graph``, its workers taken as the current members."""
        limits = max_in_flight_per_worker or {}
        return {
            node.id: self.group_signals(
                node.id,
                now,
                worker_ids=[w.id for w in node.workers],
                max_in_flight_per_worker=limits.get(node.id, 0),
            )
            for node in graph.nodes
        }

    def _tolerance(self, first_at: float, last_at: float, count: int) -> float:
        """How late a worker's first sample may be and still cover the window."""
        period = self.sample_period_s
        if count >= 2:
            # A worker reporting slower than configured still covers the window with its own period.
            period = max(period, (last_at - first_at) / (count - 1))
        return COVERAGE_TOLERANCE_PERIODS * period
