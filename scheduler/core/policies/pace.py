"""The pace model behind ``dynarl``: when will the work the rollout is generating be trained?

Algorithm 1 of DynaRL weighs shrink candidates by the job throughput each would give. In a
synchronous RL iteration the job's throughput is the iteration's tokens over its duration, and
the duration is set by two things that compete for the same GPUs:

- the **rollout's tail**: its last requests decode one token per engine step, and a step gets
  slower the more sequences (and KV cache) the engine holds, so consolidating stragglers onto
  fewer engines stretches the tail; and
- the **training pipeline** (log-probs, the trainer): fixed work in GPU-seconds that can only
  finish once the rollout has produced its last sample, plus one mini-batch after that.

``PaceModel.finish_s`` predicts the end of that work for a candidate allocation; a candidate's
gain is how much earlier the end comes, net of what the move itself costs. Everything it needs
comes from the group signals, the throughput predictor and ``PaceMemory`` (what the policy has
seen of earlier iterations of the same job), so it needs no knowledge of the trace; where the
memory is still empty (the first iteration, a restarted scheduler) it falls back to the rules
stated below.

Rollout tail
    ``PaceMemory.rollout_remaining_s``: the time the previous rollout batch took from the same
    progress to its end, scaled by how this batch's pace compares so far (the ratio of elapsed
    times, smoothed by the previous batch's duration and bounded to [0.5, 2]). While requests
    wait for a slot, no less than the outstanding requests' tokens at the current decode rate.
    Without a previous batch: the elapsed time while under 90% is done, shrinking linearly to
    zero at 100% (DESIGN.md: ~95% of requests finish within ~60% of the longest decode); and no
    less than the time since 90% was done, since stragglers that outlive that rule (rare
    outliers, far longer than the body) are as likely to last as long again as to end soon.

Consolidation slowdown
    Decode is memory-bound: an engine step costs ``a + b k`` for ``k`` running sequences (the
    weights read once, each sequence's KV read once). With ``u`` the group's utilisation (its
    decode rate over a full engine's) and ``r = k / K`` its share of the engine concurrency
    ``K``, the share of a step spent on the sequences is ``f = (u - r) / (1 - r)``. Utilisation
    is measured against a full engine at typical contexts while a drained group's stragglers
    hold long ones, so this underestimates; ``f`` is floored by a prior, raised by what the
    job's own rollout resizes measured (per-request speed before and after). Keeping ``n'`` of
    ``n`` engines stretches the remaining time by ``(1 - f) + f n / n'``. A group with requests
    waiting for a slot is capacity-bound (``f = 1``). A candidate that would load the kept
    engines above a utilisation cap is refused outright: the linear model is only good for
    lightly loaded engines, and every straggler moved is also re-prefilled.

Pipeline
    Tokens per iteration: what the trainer trained in the previous iteration, else the rollout's
    decode tokens so far extrapolated by its progress, else (nothing seen) the trainer's
    predicted rate times a default horizon. Each pipeline group's remaining GPU-seconds are its
    remaining tokens (``1 - progress``, plus one more iteration's worth while the rollout
    generates ahead of the trainer, as in asynchronous RL) over its per-GPU rate from the
    predictor. See ``PaceModel`` for how the bounds combine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.core.hypergraph import ComponentKind, Hypergraph, HyperNode, largest_worker_count
from scheduler.core.predictor import ThroughputPredictor
from scheduler.core.signals import GroupSignals

# Progress points kept of a rollout batch's curve (elapsed time at each 1/CURVE_POINTS of progress).
CURVE_POINTS = 50
# Without history: the tail is taken to last as long as the body until this share is done.
FALLBACK_TAIL_START = 0.9
# How far the pace ratio between this batch and the previous one may scale the estimate.
PACE_RATIO_BOUNDS = (0.5, 2.0)
PACE_SMOOTHING = 1.0
# Rollout progress under this tells nothing about tokens per iteration yet.
MIN_PROGRESS_FOR_TOKENS = 0.05


@dataclass(frozen=True)
class RolloutView:
    """The rollout stage (all rollout groups together) as the signals show it."""

    gpus: int
    workers: int
    in_flight: int
    queue_length: int
    progress: float
    utilisation: float
    tokens_per_s: float
    max_in_flight_per_worker: int
    in_tools: int = 0  # episodes between two turns, waiting on a tool call (agentic RL)

    @property
    def decoding_share(self) -> float:
        """Share of the unfinished episodes that wait for an engine rather than for a tool."""
        on_engines = self.in_flight + self.queue_length
        total = on_engines + self.in_tools
        return on_engines / total if total > 0 else 1.0

    @property
    def outstanding(self) -> int:
        return self.in_flight + self.queue_length

    @property
    def has_work(self) -> bool:
        """Requests on (or queued for) the engines, or episodes that will come back to them from
        a tool call."""
        return self.outstanding > 0 or self.in_tools > 0


def rollout_view(graph: Hypergraph, signals: Mapping[str, GroupSignals]) -> RolloutView | None:
    """The rollout groups' signals folded into one stage; None when the job has no rollout."""
    groups = [n for n in graph.nodes if n.kind is ComponentKind.ROLLOUT and n.id in signals]
    if not groups:
        return None
    sigs = [signals[n.id] for n in groups]
    workers = sum(len(n.workers) for n in groups)
    weighted = sum(s.utilisation_mean * len(n.workers) for n, s in zip(groups, sigs, strict=True))
    return RolloutView(
        gpus=sum(n.gpus for n in groups),
        workers=workers,
        in_flight=sum(s.in_flight for s in sigs),
        queue_length=sum(s.queue_length for s in sigs),
        progress=min(s.progress for s in sigs),
        utilisation=weighted / workers if workers else 0.0,
        tokens_per_s=sum(s.tokens_per_s for s in sigs),
        max_in_flight_per_worker=max(s.max_in_flight_per_worker for s in sigs),
        in_tools=sum(
            signals[n.id].in_flight for n in graph.nodes if n.kind is ComponentKind.TOOL and n.id in signals
        ),
    )


def kv_read_share(view: RolloutView) -> float:
    """Share of an engine step that grows with the sequences it holds, as the utilisation shows
    it (see the module doc): ``f = (u - r) / (1 - r)`` with ``r = k / K``. A lower bound in
    practice: utilisation is measured against a full engine at typical contexts, while the
    stragglers of a drained group hold longer ones."""
    if view.queue_length > 0:
        return 1.0  # requests wait for a slot: fewer engines admit proportionally fewer
    if view.workers <= 0 or view.in_flight <= 0:
        return 0.0
    full = view.max_in_flight_per_worker
    r = view.in_flight / view.workers / full if full > 0 else 1.0
    if r >= 1.0 or view.utilisation >= 1.0:
        return 1.0
    return min(1.0, max(0.0, (view.utilisation - r) / (1.0 - r)))


def consolidation_slowdown(
    view: RolloutView, gpus_after: float, kv_share_floor: float = 0.0, max_utilisation: float = 1.0
) -> float:
    """Factor by which the rollout's remaining time stretches when it keeps ``gpus_after``.

    Infinite when the engines kept would run above ``max_utilisation`` with the load spread over
    them (the linear model below only holds for lightly loaded engines, and consolidating many
    stragglers also re-prefills their contexts); otherwise ``(1 - f) + f n / n'`` with ``f`` the
    larger of the utilisation's estimate and ``kv_share_floor``, applied to the share of the
    unfinished episodes that are on the engines (those waiting on a tool call do not slow down:
    a multi-turn tail is paced by its tools as much as by its decoding)."""
    if gpus_after <= 0:
        return math.inf
    if view.gpus <= 0:
        return 1.0
    ratio = view.gpus / gpus_after
    if ratio > 1.0 and view.queue_length == 0 and view.utilisation * ratio > max_utilisation:
        return math.inf
    f = max(kv_read_share(view), min(1.0, max(0.0, kv_share_floor)))
    return 1.0 + view.decoding_share * f * (ratio - 1.0)


class PaceMemory:
    """What the policy remembers of the job's iterations between ticks (JSON-serialisable).

    - the rollout batch it works on (a batch starts when the rollout's progress restarts or it
      gets work after having none; it ends when everything is done), its start time, its decode
      tokens and its progress curve; the previous batch's curve and duration;
    - the tokens the trainer trained in the current and the previous iteration;
    - how many rollout batches were started, to tell a rollout generating ahead of the trainer
      (asynchronous RL) from one working on the trainer's own iteration.
    """

    def __init__(self) -> None:
        self.last_at: float | None = None
        self.iteration: int | None = None
        self.trained_tokens = 0.0
        self.previous_trained_tokens: float | None = None
        self.batches_started = 0
        self.batch_started_at = 0.0
        self.batch_tokens = 0.0
        self.batch_done = False
        self.curve: list[float] = []  # elapsed seconds at progress i / CURVE_POINTS
        self.previous_curve: list[float] = []
        self.previous_duration_s: float | None = None
        self.batch_whole = True  # seen from its first requests (not joined half-way)
        self.last_progress: float | None = None
        self.kv_share: float | None = None  # measured share of a step that grows with the batch
        self.probe: dict[str, float] | None = None  # a rollout resize being measured
        self.stale_progress = False  # a batch began while the progress still read the last one's end

    # -- observation -----------------------------------------------------------------------

    def observe(self, graph: Hypergraph, signals: Mapping[str, GroupSignals], now: float) -> None:
        dt = 0.0 if self.last_at is None else max(0.0, now - self.last_at)
        self.last_at = now
        if graph.iteration != self.iteration:
            if self.iteration is not None:
                self.previous_trained_tokens = self.trained_tokens
            self.iteration = graph.iteration
            self.trained_tokens = 0.0
        for node in graph.nodes:
            sig = signals.get(node.id)
            if sig is not None and node.kind is ComponentKind.ACTOR:
                self.trained_tokens += sig.tokens_per_s * dt
        view = rollout_view(graph, signals)
        if view is None or view.workers == 0:
            # No engines (a synchronous rollout that gave all of them up once its batch was
            # done): no samples, so nothing to learn about the batch; its progress reads 0.
            return
        self._measure(view, now)
        # A batch ends when its last episode is done. An asynchronous job may already have the
        # next batch running: the progress then drops to that batch's without ever showing 1.
        restarted = self.last_progress is not None and view.progress + 1e-9 < self.last_progress
        if self.stale_progress:
            # The batch started on new requests while the progress still read the last one's
            # end (a report that lags the requests): its progress restarting is the same batch
            # catching up, and until it does, the progress says nothing about this batch.
            if restarted:
                restarted = False
                self.stale_progress = False
                self.curve = []
            elif view.progress >= 1.0 - 1e-9 and view.outstanding > 0:
                self.last_progress = view.progress
                self.batch_tokens += view.tokens_per_s * dt
                return
            else:
                self.stale_progress = False
        if restarted and not self.batch_done and self.batches_started > 0:
            self._finish_batch(now - dt if dt > 0 else now)
        new_work = self.batch_done and view.outstanding > 0
        if self.batches_started == 0 or restarted or new_work:
            stale = new_work and not restarted and view.progress >= 1.0 - 1e-9
            self._start_batch(
                now - dt if dt > 0 else now, whole=stale or view.progress < MIN_PROGRESS_FOR_TOKENS
            )
            if stale:
                self.stale_progress = True
                self.last_progress = view.progress
                self.batch_tokens += view.tokens_per_s * dt
                return
        self.last_progress = view.progress
        self.batch_tokens += view.tokens_per_s * dt
        if self.batch_done:
            return
        elapsed = now - self.batch_started_at
        reached = min(CURVE_POINTS, int(view.progress * CURVE_POINTS + 1e-9))
        while len(self.curve) <= reached:
            self.curve.append(elapsed)
        if view.progress >= 1.0 - 1e-9:
            self._finish_batch(now)

    def _finish_batch(self, at: float) -> None:
        elapsed = max(0.0, at - self.batch_started_at)
        while len(self.curve) <= CURVE_POINTS:
            self.curve.append(elapsed)
        self.batch_done = True
        if self.batch_whole:
            # Only a batch seen from its start tells how long a batch takes.
            self.previous_curve = list(self.curve)
            self.previous_duration_s = elapsed

    def note_rollout_resize(self, view: RolloutView, gpus_after: int, now: float, settle_s: float) -> None:
        """A move about to change the rollout's GPUs: measure its effect once it has settled."""
        if view.queue_length > 0 or view.in_flight <= 0 or view.tokens_per_s <= 0 or view.gpus <= 0:
            self.probe = None
            return
        self.probe = {
            "gpus_before": float(view.gpus),
            "gpus_after": float(gpus_after),
            "speed_before": view.tokens_per_s / view.in_flight,
            "ready_at": now + settle_s,
        }

    def _measure(self, view: RolloutView, now: float) -> None:
        """Per-request decode speed after a resize against before: ``slowdown = (1 - f) + f n/n'``
        solved for ``f``, averaged with what earlier resizes measured."""
        probe = self.probe
        if probe is None or now < probe["ready_at"]:
            return
        self.probe = None
        if view.gpus != int(probe["gpus_after"]) or view.queue_length > 0 or view.in_flight <= 0:
            return  # another move, or a new batch, got in the way
        speed_after = view.tokens_per_s / view.in_flight
        ratio = probe["gpus_before"] / probe["gpus_after"]
        if speed_after <= 0 or abs(ratio - 1.0) < 0.05:
            return
        observed = (probe["speed_before"] / speed_after - 1.0) / (ratio - 1.0)
        observed = min(1.0, max(0.0, observed))
        self.kv_share = observed if self.kv_share is None else (self.kv_share + observed) / 2.0

    def _start_batch(self, at: float, *, whole: bool = True) -> None:
        self.batches_started += 1
        self.batch_whole = whole
        self.batch_started_at = at
        self.batch_tokens = 0.0
        self.batch_done = False
        self.curve = []

    # -- estimates -------------------------------------------------------------------------

    def batches_ahead(self, iteration: int) -> int:
        """Rollout batches started beyond the one the trainer's ``iteration`` needs (0 when
        synchronous, 1 for a rollout generating the next iteration while the trainer trains)."""
        if self.batches_started == 0:
            return 0
        return max(0, self.batches_started - 1 - iteration)

    def generating_ahead(self, iteration: int) -> bool:
        """At the start of trainer ``iteration``: has the rollout already started its batch (the
        job generates ahead, asynchronous RL) rather than waiting for the new weights?"""
        return self.batches_started > iteration

    def rollout_remaining_s(
        self, view: RolloutView, now: float, *, cap_s: float, episodes_per_batch: int = 0
    ) -> float:
        """Seconds the rollout's current batch still needs at its current allocation.

        From the previous batch's curve (see the module doc); and, while requests wait for a slot
        (the rollout is capacity-bound, e.g. a new batch submitted behind the stragglers of the
        last one), no less than its outstanding requests' tokens at its current decode rate."""
        if self.batch_done or not view.has_work:
            return 0.0
        backlog_s = 0.0
        if (
            view.queue_length > 0
            and view.tokens_per_s > 0
            and self.previous_trained_tokens
            and episodes_per_batch > 0
        ):
            # Tokens per request from what the trainer trains per iteration (prompts included:
            # an upper bound on what is left to decode).
            per_request = self.previous_trained_tokens / episodes_per_batch
            backlog_s = view.outstanding * per_request / view.tokens_per_s
        elapsed = max(1.0, now - self.batch_started_at)
        p = min(1.0, max(0.0, view.progress))
        if self.previous_curve and self.previous_duration_s is not None:
            index = min(len(self.previous_curve) - 1, int(p * CURVE_POINTS + 1e-9))
            reached_then = max(1.0, self.previous_curve[index])
            low, high = PACE_RATIO_BOUNDS
            # Early in the batch the ratio is noise: both times are smoothed by a share of the
            # previous batch's duration.
            smooth = PACE_SMOOTHING * self.previous_duration_s
            ratio = min(high, max(low, (elapsed + smooth) / (reached_then + smooth)))
            remaining = max(0.0, self.previous_duration_s - reached_then) * ratio
        else:
            remaining = elapsed * min(1.0, (1.0 - p) / (1.0 - FALLBACK_TAIL_START))
            tail_start = int(FALLBACK_TAIL_START * CURVE_POINTS)
            if len(self.curve) > tail_start:
                # Requests still decoding long after the tail began outlive the rule above:
                # expect them to take at least as long again as they have since.
                remaining = max(remaining, elapsed - self.curve[tail_start])
        return min(cap_s, max(remaining, backlog_s, 1.0))

    def tokens_per_iteration(self, view: RolloutView | None) -> float:
        """Tokens the trainer trains per iteration (see the module doc)."""
        if self.previous_trained_tokens:
            return self.previous_trained_tokens
        if view is None or view.progress < MIN_PROGRESS_FOR_TOKENS or self.batch_tokens <= 0:
            return 0.0
        return self.batch_tokens / view.progress

    # -- persistence -----------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "last_at": self.last_at,
            "iteration": self.iteration,
            "trained_tokens": self.trained_tokens,
            "previous_trained_tokens": self.previous_trained_tokens,
            "batches_started": self.batches_started,
            "batch_started_at": self.batch_started_at,
            "batch_tokens": self.batch_tokens,
            "batch_done": self.batch_done,
            "curve": list(self.curve),
            "previous_curve": list(self.previous_curve),
            "previous_duration_s": self.previous_duration_s,
            "batch_whole": self.batch_whole,
            "last_progress": self.last_progress,
            "kv_share": self.kv_share,
            "probe": dict(self.probe) if self.probe is not None else None,
            "stale_progress": self.stale_progress,
        }

    def load(self, data: Mapping[str, Any]) -> None:
        def opt(key: str) -> float | None:
            value = data.get(key)
            return None if value is None else float(value)

        self.last_at = opt("last_at")
        iteration = data.get("iteration")
        self.iteration = None if iteration is None else int(iteration)
        self.trained_tokens = float(data.get("trained_tokens", 0.0))
        self.previous_trained_tokens = opt("previous_trained_tokens")
        self.batches_started = int(data.get("batches_started", 0))
        self.batch_started_at = float(data.get("batch_started_at", 0.0))
        self.batch_tokens = float(data.get("batch_tokens", 0.0))
        self.batch_done = bool(data.get("batch_done", False))
        self.curve = [float(v) for v in data.get("curve", [])]
        self.previous_curve = [float(v) for v in data.get("previous_curve", [])]
        self.previous_duration_s = opt("previous_duration_s")
        self.batch_whole = bool(data.get("batch_whole", True))
        self.last_progress = opt("last_progress")
        self.kv_share = opt("kv_share")
        probe = data.get("probe")
        self.probe = {k: float(v) for k, v in probe.items()} if probe else None
        self.stale_progress = bool(data.get("stale_progress", False))


def largest_valid_gpus(node: HyperNode, gpus: int) -> int:
    """The GPUs of the largest valid worker count the group can run within ``gpus``."""
    per_worker = node.parallelism.gpus_per_worker
    workers = largest_worker_count(
        gpus // per_worker,
        min_workers=node.min_workers,
        max_workers=node.max_workers,
        valid_dp=node.parallelism.valid_dp,
    )
    return workers * per_worker


def _max_excluding(ranked: Sequence[tuple[float, str]], excluded: Mapping[str, int]) -> float:
    """The largest value of ``ranked`` (sorted, largest first) whose group is not ``excluded``."""
    for value, group_id in ranked:
        if group_id not in excluded:
            return value
    return -math.inf


class PaceModel:
    """Predicted end of the rollout's current batch being trained, per allocation (module doc).

    Built once per tick; ``finish_s`` evaluates a candidate (group id -> GPUs after the move) in
    time independent of the number of non-trainer groups: their terms are computed once, and a
    candidate only recomputes the groups it changes, and each trainer (a job has one or a few),
    whose time depends on when the groups upstream of it are done.

    Pipeline bounds, in seconds from now:

    - all remaining pipeline GPU-seconds over the GPUs of the pipeline groups that have work now
      (a group waiting for input does not count: its GPUs idle until the input comes); with none
      working yet, over the pipeline's GPUs, and in a synchronous iteration only until the
      rollout's end, every GPU joining them from then on (``_waiting_pipeline_s``): GPUs the
      pipeline lends the rollout before its input comes cost it nothing;
    - each log-prob (or other non-trainer) group: the rollout's end plus one mini-batch through
      it, and, while it has work, its remaining work at its size;
    - each trainer: the last of those plus one mini-batch, and its remaining work at its size
      while it has work, or at the largest data-parallel size it can reach while it waits. In a
      synchronous iteration a trainer with work keeps its size only until the groups upstream of
      it are done: from then on nothing else needs GPUs until the next batch, the drained groups
      pool theirs into it (``DynaRLPolicy._pooled_candidates``), and the rest of its work runs at
      the largest size it can reach. Without that, GPUs that would finish the upstream work
      sooner look worthless whenever the trainer, at its size now, has the most work left.
    """

    def __init__(
        self,
        graph: Hypergraph,
        signals: Mapping[str, GroupSignals],
        predictor: ThroughputPredictor,
        memory: PaceMemory,
        now: float,
        *,
        n_minibatches: int,
        max_horizon_s: float,
        kv_share_prior: float,
        max_consolidated_utilisation: float = 1.0,
        default_horizon_s: float = 30.0,
    ) -> None:
        self.now = now
        # What the job's own resizes measured can only make the model more careful than its prior.
        self.kv_share_floor = max(kv_share_prior, memory.kv_share or 0.0)
        self.max_utilisation = max_consolidated_utilisation
        self.nodes: dict[str, HyperNode] = {n.id: n for n in graph.nodes}
        self.gpus: dict[str, int] = {n.id: n.gpus for n in graph.nodes}
        self.total_gpus = sum(self.gpus.values())
        self.rollout = rollout_view(graph, signals)
        self.rollout_ids = tuple(n.id for n in graph.nodes if n.kind is ComponentKind.ROLLOUT)
        self.tokens = memory.tokens_per_iteration(self.rollout)
        if self.tokens <= 0:
            # Nothing seen yet: assume the trainer (else the largest pipeline group) has
            # ``default_horizon_s`` of work at its current size.
            rates = [
                predictor.predict(n.id, n.kind, self.effective_gpus(n, self.gpus[n.id]))
                for n in graph.nodes
                if n.kind is not ComponentKind.ROLLOUT
                and self.gpus[n.id] > 0
                and (
                    n.kind is ComponentKind.ACTOR
                    or not any(o.kind is ComponentKind.ACTOR for o in graph.nodes)
                )
            ]
            self.tokens = max(rates, default=0.0) * default_horizon_s
        episodes = max((e.items_total for e in graph.edges if e.source in self.rollout_ids), default=0)
        self.rollout_s = (
            memory.rollout_remaining_s(self.rollout, now, cap_s=max_horizon_s, episodes_per_batch=episodes)
            if self.rollout
            else 0.0
        )
        ahead = memory.batches_ahead(graph.iteration)
        self.batches_ahead = ahead
        # Tokens the predicted span trains: the trainer's remaining share of this iteration plus
        # the iterations the rollout generates ahead of it.
        trainer_progress = max(
            (
                signals[n.id].progress
                for n in graph.nodes
                if n.kind is ComponentKind.ACTOR and n.id in signals
            ),
            default=0.0,
        )
        self.tokens_to_train = self.tokens * (max(0.0, 1.0 - trainer_progress) + ahead)
        # Only a synchronous iteration leaves the rollout's GPUs free once its batch is done; and
        # only once it is done is the upstream end known well enough to count on: a rollout's
        # tail estimate that comes out short would starve a trainer with work queued.
        self.trainer_inherits = ahead == 0 and (self.rollout is None or not self.rollout.has_work)
        self.pipeline: list[HyperNode] = [
            n for n in graph.nodes if n.kind is not ComponentKind.ROLLOUT and self.gpus[n.id] > 0
        ]
        self.work_gpu_s: dict[str, float] = {}  # remaining GPU-seconds per pipeline group
        self.minibatch_gpu_s: dict[str, float] = {}  # one mini-batch's GPU-seconds per group
        self.active: set[str] = set()  # pipeline groups with work queued or running now
        self.trainer_cap: dict[str, int] = {}
        minimum = {
            n.id: n.min_workers * n.parallelism.gpus_per_worker if self.gpus[n.id] > 0 else 0
            for n in graph.nodes
        }
        minimum_total = sum(minimum.values())
        minibatch_tokens = self.tokens / max(1, n_minibatches)
        for node in self.pipeline:
            sig = signals.get(node.id)
            progress = sig.progress if sig is not None else 0.0
            reference = max(self.effective_gpus(node, self.gpus[node.id]), node.parallelism.gpus_per_worker)
            rate = predictor.predict(node.id, node.kind, reference) / reference
            remaining = self.tokens * (max(0.0, 1.0 - progress) + ahead)
            self.work_gpu_s[node.id] = remaining / rate if rate > 0 else math.inf
            self.minibatch_gpu_s[node.id] = minibatch_tokens / rate if rate > 0 else math.inf
            if sig is not None and (sig.queue_length > 0 or sig.in_flight > 0):
                self.active.add(node.id)
            if node.kind is ComponentKind.ACTOR:
                others = minimum_total - minimum[node.id]
                cap = largest_valid_gpus(node, max(0, self.total_gpus - others))
                self.trainer_cap[node.id] = max(cap, self.effective_gpus(node, self.gpus[node.id]))
        # Per-group terms at the current allocation, ranked, so a candidate recomputes only the
        # groups it changes.
        drain: list[tuple[float, str]] = []
        own: list[tuple[float, str]] = []
        trainer_drain: list[tuple[float, str]] = []
        self.trainers: dict[str, int] = {}  # trainer id -> useful GPUs now
        self.base_useful = 0
        self.base_active = 0
        self.base_work = 0.0
        self.infeasible: set[str] = set()  # pipeline groups that could not run as they are
        for node in self.pipeline:
            useful = self.effective_gpus(node, self.gpus[node.id])
            if useful <= 0:
                self.infeasible.add(node.id)
                continue
            self.base_useful += useful
            if node.id in self.active:
                self.base_active += useful
            self.base_work += self.work_gpu_s[node.id]
            terms = self._terms(node, useful)
            if node.kind is ComponentKind.ACTOR:
                trainer_drain.append((terms[0], node.id))
                self.trainers[node.id] = useful
            else:
                drain.append((terms[0], node.id))
                own.append((terms[1], node.id))
        self._ranked = tuple(sorted(terms, reverse=True) for terms in (drain, own, trainer_drain))

    @staticmethod
    def effective_gpus(node: HyperNode, gpus: int) -> int:
        """GPUs that do work: a trainer only uses its largest valid data-parallel size."""
        if node.kind is ComponentKind.ACTOR:
            return largest_valid_gpus(node, gpus)
        return gpus

    def _terms(self, node: HyperNode, useful: int) -> tuple[float, float]:
        """(one mini-batch through the group, its own remaining work) in seconds at ``useful``
        GPUs. A group with work keeps the GPUs it has for all of its remaining work as far as the
        model knows (a move is what changes that). A trainer's own time depends on the upstream
        end (``_trainer_own``), so only its mini-batch term is given here."""
        minibatch = self.minibatch_gpu_s[node.id] / useful
        if node.kind is ComponentKind.ACTOR:
            return minibatch, -math.inf
        return minibatch, self.work_gpu_s[node.id] / useful if node.id in self.active else -math.inf

    def _trainer_own(self, trainer_id: str, useful: int, *, upstream_end_s: float) -> float:
        """Seconds a trainer with ``useful`` GPUs needs for its remaining work, the upstream
        groups being done ``upstream_end_s`` from now (see the class doc); a trainer waiting for
        input is expected to reach the largest size it can get."""
        work = self.work_gpu_s[trainer_id]
        reach = max(self.trainer_cap.get(trainer_id, useful), useful)
        if trainer_id not in self.active:
            return work / reach
        if not self.trainer_inherits or work <= useful * upstream_end_s:
            return work / useful
        return upstream_end_s + (work - useful * upstream_end_s) / reach

    def rollout_gpus(self, changes: Mapping[str, int]) -> int:
        base = self.rollout.gpus if self.rollout is not None else 0
        return base + sum(gpus - self.gpus[g] for g, gpus in changes.items() if g in self.rollout_ids)

    def finish_s(
        self,
        changes: Mapping[str, int] | None = None,
        *,
        lost_gpu_s: float = 0.0,
        rollout_arrival_s: float = 0.0,
    ) -> float:
        """Predicted time (absolute) at which the rollout's current batch is trained, with
        ``changes`` applied, ``lost_gpu_s`` GPU-seconds of pipeline time spent on the move, and
        GPUs joining the rollout only after ``rollout_arrival_s`` (see the class doc)."""
        changes = changes or {}
        rollout_end = 0.0
        if self.rollout is not None and self.rollout_s > 0:
            gpus = self.rollout_gpus(changes)
            slowdown = consolidation_slowdown(self.rollout, gpus, self.kv_share_floor, self.max_utilisation)
            if math.isinf(slowdown):
                return math.inf
            if gpus > self.rollout.gpus and rollout_arrival_s > 0:
                # The new engines come up after the move; until then the rollout runs as is.
                head = min(self.rollout_s, rollout_arrival_s)
                rollout_end = head + (self.rollout_s - head) * slowdown
            else:
                rollout_end = self.rollout_s * slowdown
        drain_ranked, own_ranked, trainer_drain_ranked = self._ranked
        pipeline_changes = {g: v for g, v in changes.items() if g in self.work_gpu_s}
        drain = _max_excluding(drain_ranked, pipeline_changes)
        own = _max_excluding(own_ranked, pipeline_changes)
        trainer_drain = _max_excluding(trainer_drain_ranked, pipeline_changes)
        trainers = dict(self.trainers)
        useful_total = self.base_useful
        active_total = self.base_active
        for group_id, gpus in pipeline_changes.items():
            node = self.nodes[group_id]
            before = self.effective_gpus(node, self.gpus[group_id])
            useful = self.effective_gpus(node, gpus)
            if useful <= 0:
                if self.work_gpu_s[group_id] > 0 or group_id in self.active:
                    return math.inf
                # A group done with its share of the iteration may give up every GPU.
                useful_total -= max(before, 0)
                trainers.pop(group_id, None)
                continue
            useful_total += useful - max(before, 0)
            if group_id in self.active:
                active_total += useful - max(before, 0)
            minibatch, remaining = self._terms(node, useful)
            if node.kind is ComponentKind.ACTOR:
                trainer_drain = max(trainer_drain, minibatch)
                trainers[group_id] = useful
            else:
                drain, own = max(drain, minibatch), max(own, remaining)
        if any(g not in pipeline_changes for g in self.infeasible):
            return math.inf
        upstream_end = max(rollout_end, rollout_end + drain, own)
        trainer_own = max(
            (self._trainer_own(t, useful, upstream_end_s=upstream_end) for t, useful in trainers.items()),
            default=-math.inf,
        )
        last = max(upstream_end, upstream_end + trainer_drain, trainer_own)
        if active_total > 0:
            last = max(last, (self.base_work + lost_gpu_s) / active_total)
        elif useful_total > 0:
            last = max(last, self._waiting_pipeline_s(self.base_work + lost_gpu_s, useful_total, rollout_end))
        return self.now + last

    def _waiting_pipeline_s(self, work_gpu_s: float, gpus: int, rollout_end_s: float) -> float:
        """Seconds the remaining pipeline GPU-seconds take on ``gpus`` while every pipeline group
        waits for its input. In a synchronous iteration that input is the rollout's batch: the
        pipeline's GPUs can only work once samples arrive and the rollout's own join them once
        it is done, so GPUs the pipeline lends the rollout meanwhile cost it nothing until then."""
        if self.batches_ahead > 0 or self.total_gpus <= gpus or work_gpu_s <= gpus * rollout_end_s:
            return work_gpu_s / gpus
        return rollout_end_s + (work_gpu_s - gpus * rollout_end_s) / self.total_gpus
