"""The simulators' non-engine stages: CPU pools (reward, tools), log-prob workers and the trainer.

Each stage keeps the integrals its telemetry needs (busy seconds, tokens done) so a sample at any
virtual time is exact without an event per second; ``SampleMark`` turns two readings of those
integrals into a sample's utilisation and tokens.

The offline simulator (``simulator.py``) runs every stage here. The ``sim`` backend's host
(``agents/backends/sim/host.py``) runs the same workers -- ``LogProbWorker`` for its log-prob and
reward-model workers, ``TrainerWorker`` for the trainer's ranks, ``SampleMark`` for every worker's
samples -- and the same timing (``train_s``, ``stage_switch_s``), but schedules them from the
control plane's global counts instead of the queues here (docs/sim-backend.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.core.hypergraph import Device
from scheduler.core.sim.hardware import HARDWARE
from scheduler.core.sim.perf import PerfModel, largest_valid

Schedule = Callable[[float, int, object], None]  # (time, event kind, payload)

# The stages of an RL iteration, by the kind of their group (the offline simulator's group ids).
ROLLOUT = "rollout"
INFERENCE = "inference"  # reference and old-policy log-probs
REWARD = "reward"
TOOL = "tool"
ACTOR = "actor"

LOG_PROB_PASSES = 2  # reference and old-policy log-probs: two forward passes per sample


def stage_switch_s(perf: PerfModel, gpus: int, before: str, after: str) -> float:
    """A colocated switch of ``gpus`` GPUs from stage ``before`` to stage ``after``: a switch into
    or out of the rollout offloads one side's state and onloads the other's; the trainer's stages
    (log-probs, a reward model, training) run in one process and switch for free."""
    return perf.colocate_switch_s(gpus) if ROLLOUT in (before, after) else 0.0


def train_s(perf: PerfModel, flops: float, rate: float, *, minibatches: int, data_parallel: int) -> float:
    """Seconds a gang computing at ``rate`` FLOP/s with ``data_parallel`` ranks takes to train
    ``flops`` in ``minibatches`` optimizer steps, each ending with the exposed gradient sync: what
    ``Trainer`` takes for them when its membership does not change."""
    return flops / rate + minibatches * perf.grad_sync_s(data_parallel)


class SampleMark:
    """A worker's integrals at its previous telemetry sample. A sample's utilisation is the work
    done since (busy seconds, or useful work in seconds of a full worker) over the time elapsed
    times the worker's capacity; its tokens are the tokens processed since."""

    __slots__ = ("at", "tokens", "utilisation", "work")

    def __init__(self, at: float, tokens: float = 0.0, work: float = 0.0) -> None:
        self.at = at
        self.tokens = tokens
        self.work = work
        self.utilisation = 0.0  # of the last sample (its reader may overrule it)

    def take(self, now: float, tokens: float, work: float, capacity: float = 1.0) -> tuple[float, int]:
        """(utilisation, new tokens) since the previous sample; ``now`` becomes the mark."""
        span = (now - self.at) * capacity
        utilisation = min(1.0, max(0.0, (work - self.work) / span)) if span > 0 else 0.0
        new_tokens = max(0, round(tokens - self.tokens))
        self.at, self.tokens, self.work = now, tokens, work
        self.utilisation = utilisation
        return utilisation, new_tokens


class CpuWorker:
    __slots__ = ("active", "busy_slot_s", "id", "last_change")

    def __init__(self, worker_id: str, now: float) -> None:
        self.id = worker_id
        self.active = 0
        self.busy_slot_s = 0.0
        self.last_change = now

    def touch(self, now: float) -> None:
        self.busy_slot_s += self.active * (now - self.last_change)
        self.last_change = now

    def busy_at(self, now: float) -> float:
        return self.busy_slot_s + self.active * (now - self.last_change)


class CpuPool:
    """Workers with ``slots`` concurrent jobs each (verifier processes, tool sandboxes); FIFO."""

    def __init__(self, group_id: str, workers: int, slots: int, now: float) -> None:
        self.group_id = group_id
        self.slots = slots
        self.workers = [CpuWorker(f"{group_id}-w{i}", now) for i in range(workers)]
        self.queue: deque[tuple[int, float]] = deque()  # (episode, seconds)
        self.done = 0

    def submit(self, episode: int, seconds: float, now: float) -> list[tuple[float, CpuWorker, int]]:
        self.queue.append((episode, seconds))
        return self._start(now)

    def finish(self, worker: CpuWorker, now: float) -> list[tuple[float, CpuWorker, int]]:
        worker.touch(now)
        worker.active -= 1
        self.done += 1
        return self._start(now)

    def _start(self, now: float) -> list[tuple[float, CpuWorker, int]]:
        """Start queued jobs on the least loaded workers; returns (end time, worker, episode)."""
        started = []
        while self.queue:
            worker = min(self.workers, key=lambda w: w.active)
            if worker.active >= self.slots:
                break
            episode, seconds = self.queue.popleft()
            worker.touch(now)
            worker.active += 1
            started.append((now + seconds, worker, episode))
        return started

    def in_flight(self) -> int:
        return sum(w.active for w in self.workers)


@dataclass
class GpuWorkerBase:
    id: str
    devices: tuple[Device, ...]
    busy_s: float = 0.0
    busy_since: float | None = None
    tokens_done: float = 0.0

    def busy_at(self, now: float) -> float:
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)

    def set_busy(self, busy: bool, now: float) -> None:
        if busy and self.busy_since is None:
            self.busy_since = now
        elif not busy and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None


@dataclass
class LogProbWorker(GpuWorkerBase):
    """One Megatron forward-only worker computing reference and old-policy log-probs (or a reward
    model's scores): ``passes`` forward passes over each sample of its micro-batch at its GPUs'
    FLOP/s. Tokens count from the start of a micro-batch, pro rata while it runs."""

    flops_per_s: float = 0.0
    batch: list[int] = field(default_factory=list)  # episodes of the running micro-batch
    batch_token_counts: list[int] = field(default_factory=list)
    batch_tokens: int = 0
    started_at: float = 0.0
    ends_at: float = 0.0
    epoch: int = 0

    @classmethod
    def on(cls, worker_id: str, devices: tuple[Device, ...], perf: PerfModel) -> LogProbWorker:
        """A worker on ``devices``, at their FLOP/s under ``perf``."""
        rate = perf.compute_rate([HARDWARE[d.hardware] for d in devices])
        return cls(worker_id, devices, flops_per_s=rate)

    def start(self, batch: Sequence[tuple[int, int]], perf: PerfModel, passes: int, now: float) -> None:
        """Run ``batch`` ((episode, tokens) pairs): ``passes`` forward passes over each sample."""
        tokens = sum(t for _, t in batch)
        flops = passes * perf.forward_flops([t for _, t in batch])
        self.batch = [e for e, _ in batch]
        self.batch_token_counts = [t for _, t in batch]
        self.batch_tokens = tokens
        self.started_at = now
        self.ends_at = now + flops / self.flops_per_s if self.flops_per_s > 0 else math.inf
        self.tokens_done += tokens
        self.epoch += 1
        self.set_busy(True, now)

    def finish(self, now: float) -> list[int]:
        """The micro-batch is done; returns its episodes."""
        episodes = self.batch
        self.batch = []
        self.set_busy(False, now)
        return episodes

    def withdraw(self, now: float) -> list[tuple[int, int]]:
        """Stop the running micro-batch and return its (episode, tokens) to be run again; the part
        already computed stays counted."""
        self.set_busy(False, now)
        items: list[tuple[int, int]] = []
        if self.batch:
            done_fraction = (now - self.started_at) / max(self.ends_at - self.started_at, 1e-12)
            self.tokens_done -= self.batch_tokens * (1.0 - min(1.0, done_fraction))
            items = list(zip(self.batch, self.batch_token_counts, strict=True))
        self.batch = []
        self.epoch += 1
        return items

    def cancel(self, now: float) -> None:
        """Drop the running micro-batch: none of its tokens count (it is computed again in full)."""
        if self.batch:
            self.tokens_done -= self.batch_tokens
        self.batch = []
        self.epoch += 1
        self.set_busy(False, now)

    def tokens_at(self, now: float) -> float:
        """Tokens processed by ``now``, the running micro-batch counted pro rata."""
        if not self.batch:
            return self.tokens_done
        span = max(self.ends_at - self.started_at, 1e-12)
        undone = 1.0 - min(1.0, max(0.0, (now - self.started_at) / span))
        return self.tokens_done - self.batch_tokens * undone


class LogProbPool:
    """FIFO of finished, scored episodes; each worker runs one micro-batch at a time."""

    def __init__(self, perf: PerfModel, micro_batch_tokens: int, passes: int) -> None:
        self.perf = perf
        self.micro_batch_tokens = micro_batch_tokens
        self.passes = passes  # forward passes per sample: reference + old policy
        self.workers: list[LogProbWorker] = []
        self.queue: deque[tuple[int, int]] = deque()  # (episode, tokens)
        self.queued_tokens = 0
        self.done = 0

    def add_worker(self, worker_id: str, devices: tuple[Device, ...]) -> LogProbWorker:
        worker = LogProbWorker.on(worker_id, devices, self.perf)
        self.workers.append(worker)
        return worker

    def remove_worker(self, worker: LogProbWorker, now: float) -> None:
        """The worker leaves; its micro-batch goes back to the head of the queue."""
        self.workers.remove(worker)
        for episode, tokens in reversed(worker.withdraw(now)):
            self.queue.appendleft((episode, tokens))
            self.queued_tokens += tokens

    def submit(self, episode: int, tokens: int) -> None:
        self.queue.append((episode, tokens))
        self.queued_tokens += tokens

    def start_idle(self, now: float) -> list[LogProbWorker]:
        """Give each idle worker a micro-batch; returns the workers that started one."""
        started = []
        for worker in self.workers:
            if worker.batch or not self.queue:
                continue
            batch: list[tuple[int, int]] = []
            tokens = 0
            while self.queue and (not batch or tokens + self.queue[0][1] <= self.micro_batch_tokens):
                item = self.queue.popleft()
                self.queued_tokens -= item[1]
                batch.append(item)
                tokens += item[1]
            worker.start(batch, self.perf, self.passes, now)
            started.append(worker)
        return started

    def finish(self, worker: LogProbWorker, now: float) -> list[int]:
        episodes = worker.finish(now)
        self.done += len(episodes)
        return episodes


@dataclass
class MiniBatch:
    batch: int  # which iteration's data
    index: int  # position within the iteration
    episodes: tuple[int, ...]
    tokens: int
    flops: float


@dataclass
class TrainerWorker(GpuWorkerBase):
    """One data-parallel rank group; its telemetry is its share of the gang's."""


class Trainer:
    """The actor: one gang of data-parallel workers training mini-batches in iteration order.

    The running step is a fluid: ``remaining_flops`` at the gang's rate, then the exposed gradient
    sync. A resize or a pause (p2p migration) takes effect at the current instant, as if at a
    micro-batch boundary.
    """

    def __init__(self, perf: PerfModel, valid_dp: Sequence[int]) -> None:
        self.perf = perf
        self.valid_dp = tuple(valid_dp)
        self.workers: list[TrainerWorker] = []
        self.ready: dict[int, deque[MiniBatch]] = {}
        self.current: MiniBatch | None = None
        self.remaining_flops = 0.0
        self.remaining_sync_s = 0.0
        self.segment_start = 0.0
        self.paused_until = 0.0
        self.epoch = 0
        self.tokens_trained = 0.0
        self.next_batch = 0  # the iteration whose mini-batches it trains now
        self.trained_in_batch = 0
        self.pause_gpu_s = 0.0
        self.busy_s = 0.0  # seconds the gang computed or synced gradients
        self._busy_mark = 0.0

    # -- membership ------------------------------------------------------------------------

    def active_workers(self) -> list[TrainerWorker]:
        return self.workers[: largest_valid(len(self.workers), self.valid_dp)]

    def rate(self) -> float:
        return self.perf.compute_rate(
            [HARDWARE[d.hardware] for w in self.active_workers() for d in w.devices]
        )

    def data_parallel(self) -> int:
        return len(self.active_workers())

    def gpus(self) -> int:
        return sum(len(w.devices) for w in self.workers)

    # -- progress --------------------------------------------------------------------------

    def _busy_between(self, since: float, now: float) -> float:
        if self.current is None or self.rate() <= 0:
            return 0.0
        return max(0.0, now - max(since, self.paused_until))

    def busy_at(self, now: float) -> float:
        return self.busy_s + self._busy_between(self._busy_mark, now)

    def _progress(self, now: float) -> None:
        """Consume the work done since ``segment_start`` at the rate of the current membership
        (callers run this before changing membership)."""
        self.busy_s += self._busy_between(self._busy_mark, now)
        self._busy_mark = max(self._busy_mark, now)
        start = max(self.segment_start, self.paused_until)
        if self.current is not None and now > start:
            elapsed = now - start
            rate = self.rate()
            if self.remaining_flops > 0 and rate > 0:
                used = min(elapsed, self.remaining_flops / rate)
                self.remaining_flops = max(0.0, self.remaining_flops - used * rate)
                self.tokens_trained += self.current.tokens * used * rate / self.current.flops
                elapsed -= used
            if self.remaining_flops <= 0 and elapsed > 0:
                self.remaining_sync_s = max(0.0, self.remaining_sync_s - elapsed)
        self.segment_start = max(self.segment_start, now)

    def end_time(self) -> float | None:
        """When the running step ends at the current rate; None when idle or stalled."""
        if self.current is None:
            return None
        rate = self.rate()
        if self.remaining_flops > 0 and rate <= 0:
            return None
        start = max(self.segment_start, self.paused_until)
        compute_s = self.remaining_flops / rate if self.remaining_flops > 0 else 0.0
        return start + compute_s + self.remaining_sync_s

    def change(
        self, now: float, *, add: Sequence[TrainerWorker] = (), remove: Sequence[TrainerWorker] = ()
    ) -> None:
        self._progress(now)
        for worker in remove:
            self.workers.remove(worker)
        self.workers.extend(add)
        self.epoch += 1

    def pause(self, now: float, seconds: float) -> None:
        """Stop training for ``seconds`` (state transfer); the gang's GPUs idle meanwhile."""
        self._progress(now)
        start = max(now, self.paused_until)
        self.paused_until = start + seconds
        self.pause_gpu_s += seconds * self.gpus()
        self.epoch += 1

    # -- work ------------------------------------------------------------------------------

    def offer(self, minibatch: MiniBatch) -> None:
        self.ready.setdefault(minibatch.batch, deque()).append(minibatch)

    def start_next(self, now: float) -> bool:
        """Start the next mini-batch of the current iteration if one is ready."""
        if self.current is not None:
            return False
        queue = self.ready.get(self.next_batch)
        if not queue:
            return False
        self._progress(now)
        minibatch = queue.popleft()
        self.current = minibatch
        self.remaining_flops = minibatch.flops
        self.remaining_sync_s = self.perf.grad_sync_s(max(1, self.data_parallel()))
        self.segment_start = now
        self.epoch += 1
        return True

    def finish(self, now: float) -> MiniBatch:
        self._progress(now)
        minibatch = self.current
        assert minibatch is not None
        self.current = None
        self.remaining_flops = 0.0
        self.remaining_sync_s = 0.0
        self.trained_in_batch += 1
        self.epoch += 1
        return minibatch

    def tokens_at(self, now: float) -> float:
        if self.current is None or self.remaining_flops <= 0:
            return self.tokens_trained
        start = max(self.segment_start, self.paused_until)
        if now <= start:
            return self.tokens_trained
        rate = self.rate()
        done = min(self.remaining_flops, (now - start) * rate)
        return self.tokens_trained + self.current.tokens * done / self.current.flops

    def queued(self) -> int:
        queue = self.ready.get(self.next_batch)
        return len(queue) if queue else 0
