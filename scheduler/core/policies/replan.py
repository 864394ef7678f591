"""Re-planning at iteration boundaries: learn the job from what it measured, pick the placement.

The job spec's placement is a guess made before the job ran. Whether time-sharing every GPU
(colocated, verl) or giving each group its own (disaggregated, with ``dynarl`` lending drained
GPUs to the bottleneck) is faster depends on the rollout's tail, and the tail changes as a policy
learns (responses grow), a curriculum changes prompts, or a tool gets slower. So the policy
measures each iteration (``IterationLedger``, from the same group signals every tick sees, live or
simulated), and at the boundary predicts the next iteration under both placements
(``PlacementModel``) and switches only when the other is predicted faster by a margin, and by
enough that the saving of the next few iterations pays for the switch.

What an iteration is made of (``IterationRecord``):

- the rollout's **body**: the time its engines are mostly busy, as GPU-seconds. It scales with
  the GPUs generating: on ``g`` GPUs it takes ``body_gpu_s / g``;
- the rollout's **tail**: the time most of its engines are drained (under ``u_low``), or most of
  its GPUs already lent away, while the last requests decode. It does not shrink with more GPUs: a straggler decodes one token per
  step whatever the engine count;
- the **pipeline**: GPU-seconds the log-prob and trainer groups were busy (their utilisation
  times their GPUs), and how much of it overlapped the rollout;
- the **idle** time: the rollout had nothing to generate and the pipeline groups were mostly
  idle (the boundary itself: weights pushed and checked, results reported, the next iteration
  opened). No placement shortens it, so every prediction carries it as measured.

Colocated runs the stages in turn on all ``N`` GPUs: body/N + tail + pipeline/N + two stage
switches, the body no shorter than its parts allow (a part saturated spreads over every engine;
a part paced by its requests shortens only by the share of each decode step that grew with the
sequences an engine held, which the ledger bounds from below with the job's shortest step).
Disaggregated overlaps: the body on the rollout's base GPUs, the tail with the drained GPUs lent
to the pipeline, then what is left of the pipeline on all GPUs.

Neither formula is exact. A placement the job has run under is predicted from what it measured
there (while the job's shape stays as it was); one never tried must beat the current one by the
model's own measured error on this job's last crossing. That is the no-harm rule at this level:
a wrong guess costs one iteration, and the measurement it leaves stops it from being made again
while the job stays as it is. The margin (``replan_margin``) keeps small predicted gains from
flapping the placement. A shifted split whose worst case loses nothing (GPUs to the rollout that
would leave the iteration no slower if the rollout gained nothing from them: ``body_gpus`` in
``PlacementModel.disaggregated_s``) needs only a margin for the job's pace noise; dynarl's
``bounded_replan_margin``. A switch's one-off cost is the cost model's estimate until the job has
switched once; from then on, no less than what the switch measured (the time from the boundary
to the first tick in the new layout, which is not charged to the iteration that follows). Staying
disaggregated has a boundary cost of its own, which a switch does not pay: the GPUs lent within
the iteration come home, and the rollout opens the next one short of them (``opening_s``). The
first iteration had no such opening, so staying is predicted as it took plus the opening.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from scheduler.core.costs import MigrationCostModel
from scheduler.core.hypergraph import ComponentKind, Hypergraph, MigrationStrategy
from scheduler.core.policies.base import Placement
from scheduler.core.signals import GroupSignals, MeasuredIteration

# A gap between two observations longer than this is not charged to either (a restarted
# scheduler, ticks skipped while a migration ran for long): the ledger resumes from the next tick.
MAX_OBSERVATION_GAP_S = 60.0
# The saving a never-tried placement must promise, before the job has measured how far the
# model's crossing from one placement to the other is off, and the range that measurement may set.
TRIAL_MARGIN_PRIOR = 0.1
TRIAL_MARGIN_BOUNDS = (0.1, 0.5)
# A change of the rollout's tail share (tail seconds over rollout seconds) by more than this
# makes a measurement of the other placement stale.
SHAPE_CHANGE = 0.15
# A switch's one-off cost is paid back by the saving of the iterations that follow it: this many
# (the saving is re-predicted at every boundary, so a horizon much longer trusts it too far).
PAYBACK_ITERATIONS = 3
# Without a measurement of the disaggregated tail: the share of the rollout's GPUs that keep
# its stragglers once it has drained (the rest are lent to the pipeline).
TAIL_GPUS_PRIOR = 0.25
# A rollout whose engines are busy on average at this utilisation or more is saturated: more
# engines would take on part of its work at once.
SATURATED_UTILISATION = 0.9
# A rollout's requests in flight that stay within this share of a count count as a steady load:
# a decode step read from the rate of a window over it is the step at that load.
STEADY_LOAD = 0.02


@dataclass(frozen=True)
class IterationRecord:
    """What one iteration measured (seconds and GPU-seconds), under one placement."""

    iteration: int
    placement: Placement
    duration_s: float
    total_gpus: int
    rollout_body_s: float
    rollout_body_gpu_s: float
    rollout_tail_s: float
    rollout_tail_gpu_s: float  # GPU-seconds the rollout held while drained
    pipeline_gpu_s: float  # busy GPU-seconds of the log-prob and trainer groups
    pipeline_overlap_gpu_s: float  # the part done while the rollout still generated
    tokens: float  # what the trainer trained (its tokens/s over the iteration)
    idle_s: float = 0.0  # nothing generating and the pipeline mostly idle (the boundary itself)
    log_prob_gpu_s: float = 0.0  # the log-prob groups' share of ``pipeline_gpu_s`` (ticks' records)
    # The part of the rollout it spent saturated (requests waiting for a slot, or its engines
    # busy on average at ``SATURATED_UTILISATION`` or more), and the GPU-seconds it held then:
    # work bound by how many engines there are, not by how long one request takes.
    rollout_saturated_s: float = 0.0
    rollout_saturated_gpu_s: float = 0.0
    # The rest of the body, paced by its requests: its seconds, the GPU-seconds it held then, and
    # its seconds weighted by the share of an engine step that grew with the sequences the
    # engine held (``IterationLedger.sequence_share``). Spread over more engines, each holds
    # fewer sequences, and that share of every step shrinks with them.
    rollout_paced_s: float = 0.0
    rollout_paced_gpu_s: float = 0.0
    rollout_paced_sequence_s: float = 0.0
    # Stages the job's driver timed one after another, each on its own group's GPUs (group kind
    # -> busy GPU-seconds and the GPUs it ran on), the rollout's included; empty for an iteration
    # the ticks measured (stages overlapping, GPUs lent between them).
    stages: Mapping[str, tuple[float, int]] = field(default_factory=dict)

    @property
    def rollout_s(self) -> float:
        return self.rollout_body_s + self.rollout_tail_s

    @property
    def tail_share(self) -> float:
        """How much of the rollout its tail was: the job's shape, as one placement sees it."""
        return self.rollout_tail_s / self.rollout_s if self.rollout_s > 0 else 0.0

    @property
    def tail_gpus(self) -> float:
        return self.rollout_tail_gpu_s / self.rollout_tail_s if self.rollout_tail_s > 0 else 0.0

    def paced_on_s(self, gpus: int) -> float:
        """The request-paced part of the body with its sequences spread over ``gpus`` GPUs'
        engines instead of the ones it ran on: each step's share that grew with the sequences
        held scales with how many each engine holds; the rest (the weights read, the step's
        fixed cost) stays. Never longer than measured: only more GPUs are asked about."""
        if self.rollout_paced_s <= 0:
            return 0.0
        ran_on = self.rollout_paced_gpu_s / self.rollout_paced_s
        share = min(1.0, max(0.0, self.rollout_paced_sequence_s / self.rollout_paced_s))
        return self.rollout_paced_s * ((1.0 - share) + share * min(1.0, ran_on / max(1, gpus)))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["placement"] = self.placement.value
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IterationRecord:
        # A field added since the state was written keeps its default.
        values: dict[str, Any] = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        values["placement"] = Placement(values["placement"])
        values["stages"] = {
            kind: (float(gpu_s), int(gpus)) for kind, (gpu_s, gpus) in values.get("stages", {}).items()
        }
        return cls(**values)


def measured_record(measured: MeasuredIteration, graph: Hypergraph, placement: Placement) -> IterationRecord:
    """What the job's driver measured of an iteration (``MeasuredIteration``), as the placement
    model reads an iteration, on the GPUs ``graph`` holds. The phases ran one after the other:
    no pipeline work overlapped the rollout, and the driver does not split the rollout into body
    and tail (the colocated model then keeps it whole). What the phases do not cover (rewards,
    checks, the boundary itself) is idle time for every GPU group."""

    def gpus(kind: ComponentKind) -> int:
        return sum(node.gpus for node in graph.by_kind(kind))

    worked = measured.generate_s + sum(measured.busy_s.values())
    return IterationRecord(
        iteration=measured.iteration,
        placement=placement,
        duration_s=measured.duration_s,
        total_gpus=len(gpu_device_ids(graph)),
        rollout_body_s=measured.generate_s,
        rollout_body_gpu_s=measured.generate_s * gpus(ComponentKind.ROLLOUT),
        rollout_tail_s=0.0,
        rollout_tail_gpu_s=0.0,
        pipeline_gpu_s=sum(seconds * gpus(kind) for kind, seconds in measured.busy_s.items()),
        pipeline_overlap_gpu_s=0.0,
        tokens=measured.tokens,
        idle_s=max(0.0, measured.duration_s - worked),
        stages={
            ComponentKind.ROLLOUT.value: (
                measured.generate_s * gpus(ComponentKind.ROLLOUT),
                gpus(ComponentKind.ROLLOUT),
            ),
            **{
                kind.value: (seconds * gpus(kind), gpus(kind))
                for kind, seconds in measured.busy_s.items()
                if seconds > 0 and gpus(kind) > 0
            },
        },
    )


class IterationLedger:
    """Integrates the group signals of one iteration, tick by tick, into an ``IterationRecord``.

    A tick's interval (since the previous one) is charged to what that tick sees: the rollout in
    its body (has requests, most engines busy) or its tail (has requests, more than
    ``low_fraction_threshold`` of its engines under ``u_low``), and the pipeline groups' busy
    GPU-seconds (utilisation times GPUs). A tick with nothing generating and the pipeline busy
    on less than ``u_low`` of its GPUs is idle time. A generating tick with requests waiting or
    the engines busy on average at ``SATURATED_UTILISATION`` is also charged to the saturated
    part of the rollout, the part that more engines would shorten.

    A rollout that generates its whole batch between two ticks (or before the iteration's first
    one) is never seen generating: the first interval that finds it at the end of its batch is
    charged to its body, as the most it took.

    While the job is laid out anew (``hold``), nothing is charged: the first tick in the new
    layout measures the switch (``switch_s``) and the iteration's clock starts again there."""

    def __init__(self, low_fraction_threshold: float, u_low: float = 0.2) -> None:
        self.threshold = low_fraction_threshold
        self.u_low = u_low
        self.iteration: int | None = None
        self.started_at = 0.0
        self.last_at: float | None = None
        self.held = False
        self.switch_s: float | None = None  # the last switch's measured seconds, until taken
        # The shortest decode step the rollout's engines took on this job, read where their load
        # held steady for a whole signal window (``_steady_step_s``): no more than the step's
        # part that does not grow with the sequences held.
        self.step_floor_s: float | None = None
        # Since when the rollout's requests in flight stayed within STEADY_LOAD of this count.
        self.steady_since: tuple[float, int] | None = None
        self._clear()

    def _clear(self) -> None:
        self.ticks = 0
        self.sums: dict[str, float] = dict.fromkeys(_SUMS, 0.0)
        self.rollout_gpus_max = 0  # the most GPUs the rollout held this iteration
        self.job_gpus_max = 0  # the most GPUs the job's GPU groups held together

    def start(self, iteration: int, now: float) -> None:
        self.iteration = iteration
        self.started_at = now
        self.last_at = now
        self._clear()

    def hold(self) -> None:
        """The job is about to be laid out anew: charge nothing until the next observation."""
        self.held = True

    def take_switch_s(self) -> float | None:
        seconds, self.switch_s = self.switch_s, None
        return seconds

    def observe(self, graph: Hypergraph, signals: Mapping[str, GroupSignals], now: float) -> None:
        if self.held:
            self.held = False
            if self.last_at is not None and now > self.last_at:
                self.switch_s = now - self.last_at
            if self.iteration == graph.iteration:
                self.started_at = now
                self.last_at = now
                return
        if self.iteration != graph.iteration:
            self.start(graph.iteration, now)
            return
        last = self.last_at if self.last_at is not None else now
        self.last_at = now
        dt = now - last
        if dt <= 0 or dt > MAX_OBSERVATION_GAP_S:
            return
        self.ticks += 1
        rollout_gpus = 0
        requests = 0
        queued = 0
        drained_workers = 0.0
        busy_workers = 0.0
        rollout_workers = 0
        in_flight = 0
        tokens_per_s = 0.0
        window_s = 0.0
        progress: list[float] = []
        for node in graph.by_kind(ComponentKind.ROLLOUT):
            sig = signals.get(node.id)
            if sig is None:
                continue
            progress.append(sig.progress)
            rollout_gpus += node.gpus
            requests += sig.in_flight + sig.queue_length
            in_flight += sig.in_flight
            tokens_per_s += sig.tokens_per_s
            window_s = max(window_s, sig.window_s)
            queued += sig.queue_length
            drained_workers += sig.low_utilisation_fraction * sig.workers
            busy_workers += sig.utilisation_mean * sig.workers
            rollout_workers += sig.workers
        generating = requests > 0
        step_s = self._steady_step_s(in_flight, tokens_per_s, window_s, now, queued)
        rollout_done = bool(progress) and min(progress) >= 1.0
        # At the end of its batch with nothing charged to it yet (no tick saw it generate): it
        # ran inside this interval, or the one before the iteration's first tick (about as long).
        charged = self.sums["rollout_body_s"] + self.sums["rollout_tail_s"] > 0
        ran_unseen = not charged and not generating and rollout_done
        engines_full = rollout_workers > 0 and busy_workers >= SATURATED_UTILISATION * rollout_workers
        saturated = generating and (queued > 0 or engines_full)
        self.rollout_gpus_max = max(self.rollout_gpus_max, rollout_gpus)
        self.job_gpus_max = max(self.job_gpus_max, len(gpu_device_ids(graph)))
        if generating:
            # The tail: most engines drained, or most of them already lent away (the stragglers
            # consolidated on the few left keep those busy, but that is still the tail).
            drained = (
                rollout_workers > 0 and drained_workers / rollout_workers > self.threshold
            ) or 2 * rollout_gpus < self.rollout_gpus_max
            phase = "tail" if drained else "body"
            self.sums[f"rollout_{phase}_s"] += dt
            self.sums[f"rollout_{phase}_gpu_s"] += rollout_gpus * dt
            if saturated:
                self.sums["rollout_saturated_s"] += dt
                self.sums["rollout_saturated_gpu_s"] += rollout_gpus * dt
            elif phase == "body":
                self.sums["rollout_paced_s"] += dt
                self.sums["rollout_paced_gpu_s"] += rollout_gpus * dt
                self.sums["rollout_paced_sequence_s"] += self.sequence_share(step_s) * dt
        elif ran_unseen:
            self.sums["rollout_body_s"] += dt
            self.sums["rollout_body_gpu_s"] += rollout_gpus * dt
        rolled = generating or ran_unseen
        pipeline_busy_gpus = 0.0
        pipeline_gpus = 0
        for kind in (ComponentKind.INFERENCE, ComponentKind.ACTOR):
            for node in graph.by_kind(kind):
                sig = signals.get(node.id)
                if sig is None or node.gpus <= 0:
                    continue
                if kind is ComponentKind.ACTOR:
                    self.sums["tokens"] += sig.tokens_per_s * dt
                pipeline_gpus += node.gpus
                pipeline_busy_gpus += node.gpus * sig.utilisation_mean
                busy = node.gpus * sig.utilisation_mean * dt
                self.sums["pipeline_gpu_s"] += busy
                if kind is ComponentKind.INFERENCE:
                    self.sums["log_prob_gpu_s"] += busy
                if rolled:
                    self.sums["pipeline_overlap_gpu_s"] += busy
        if not rolled and pipeline_busy_gpus <= self.u_low * pipeline_gpus:
            self.sums["idle_s"] += dt

    def _steady_step_s(
        self, in_flight: int, tokens_per_s: float, window_s: float, now: float, queued: int
    ) -> float | None:
        """Seconds of one decode step, as the rollout's engines ran at ``now``: each sequence in
        flight gains one token a step, so ``in_flight / tokens_per_s``. Only where the count in
        flight held within ``STEADY_LOAD`` for the whole window the rate is averaged over (the
        rate of a window in which sequences finished counts their tokens too) and nothing waited
        for a slot (prefill then shares the steps); None otherwise. The shortest such step is
        the job's ``step_floor_s``."""
        since = self.steady_since
        if in_flight <= 0 or since is None or abs(in_flight - since[1]) > STEADY_LOAD * since[1]:
            self.steady_since = (now, in_flight) if in_flight > 0 else None
            return None
        if queued > 0 or tokens_per_s <= 0 or now - since[0] < window_s:
            return None
        step_s = in_flight / tokens_per_s
        self.step_floor_s = step_s if self.step_floor_s is None else min(self.step_floor_s, step_s)
        return step_s

    def sequence_share(self, step_s: float | None) -> float:
        """The share of a step of ``step_s`` that grew with the sequences the engines held,
        at least: the part of a step that does not grow is no more than the shortest step seen.
        Zero where the step was not read."""
        if step_s is None or self.step_floor_s is None or step_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.step_floor_s / step_s)

    def close(self, now: float, total_gpus: int, placement: Placement) -> IterationRecord | None:
        """The record of the iteration ending at ``now``, run under ``placement``; None when too
        little of it was seen (a scheduler started mid-iteration)."""
        if self.iteration is None or self.ticks < 3 or self.sums["rollout_body_s"] <= 0:
            return None
        sums: dict[str, Any] = {name: self.sums[name] for name in _SUMS}
        return IterationRecord(
            iteration=self.iteration,
            placement=placement,
            duration_s=max(0.0, now - self.started_at),
            total_gpus=total_gpus,
            **sums,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "started_at": self.started_at,
            "last_at": self.last_at,
            "ticks": self.ticks,
            "sums": dict(self.sums),
            "rollout_gpus_max": self.rollout_gpus_max,
            "job_gpus_max": self.job_gpus_max,
            "held": self.held,
            "switch_s": self.switch_s,
            "step_floor_s": self.step_floor_s,
            "steady_since": list(self.steady_since) if self.steady_since is not None else None,
        }

    def load(self, data: Mapping[str, Any]) -> None:
        iteration = data.get("iteration")
        self.iteration = None if iteration is None else int(iteration)
        self.started_at = float(data.get("started_at", 0.0))
        last = data.get("last_at")
        self.last_at = None if last is None else float(last)
        self.ticks = int(data.get("ticks", 0))
        self.rollout_gpus_max = int(data.get("rollout_gpus_max", 0))
        self.job_gpus_max = int(data.get("job_gpus_max", 0))
        self.held = bool(data.get("held", False))
        switch = data.get("switch_s")
        self.switch_s = None if switch is None else float(switch)
        floor = data.get("step_floor_s")
        self.step_floor_s = None if floor is None else float(floor)
        steady = data.get("steady_since")
        self.steady_since = (float(steady[0]), int(steady[1])) if steady else None
        self.sums = {name: float(data.get("sums", {}).get(name, 0.0)) for name in _SUMS}


_SUMS = (
    "rollout_body_s",
    "rollout_body_gpu_s",
    "rollout_tail_s",
    "rollout_tail_gpu_s",
    "pipeline_gpu_s",
    "pipeline_overlap_gpu_s",
    "tokens",
    "idle_s",
    "log_prob_gpu_s",
    "rollout_saturated_s",
    "rollout_saturated_gpu_s",
    "rollout_paced_s",
    "rollout_paced_gpu_s",
    "rollout_paced_sequence_s",
)


GPU_KINDS = (ComponentKind.ROLLOUT, ComponentKind.INFERENCE, ComponentKind.ACTOR)


def gpu_device_ids(graph: Hypergraph) -> set[str]:
    """The devices the job's GPU groups hold (each once, time-shared or not)."""
    return {d for node in graph.nodes if node.kind in GPU_KINDS for d in node.device_ids}


def time_shared(graph: Hypergraph) -> bool:
    """Whether every GPU group of the job takes turns on the same devices (a colocated
    placement): every group on devices of the largest one (a trainer whose valid sizes stop
    short of all of them spans fewer). A job where only some groups share devices is not: its
    other groups may move."""
    held = [frozenset(node.device_ids) for node in graph.nodes if node.kind in GPU_KINDS and node.gpus]
    widest = max(held, key=len, default=frozenset())
    return len(held) > 1 and all(devices <= widest for devices in held)


@dataclass(frozen=True)
class PlacementModel:
    """Seconds an iteration like ``record`` takes under each placement (before corrections)."""

    cost_model: MigrationCostModel
    n_minibatches: int

    def stage_switches_s(self, gpus: int) -> float:
        """Colocated: the rollout's engines and the trainer's state swap places twice an
        iteration, each side's state moved per GPU at the cost model's transfer rate. The swaps
        happen on each host, inside the job, so what the deployment adds to moves carried out
        through the control plane (the cost model's measured scale) is not charged to them."""
        in_job = replace(self.cost_model, measured_scale=1.0)
        return 2.0 * in_job.estimate_s(MigrationStrategy.P2P, gpus_moved=gpus, recipient_gpus_after=gpus)

    def colocated_s(self, record: IterationRecord, pipeline_gpus: int | None = None) -> float:
        """The stages in turn on all GPUs: the rollout's body spread over every engine, its
        tail as long as it was (a straggler decodes one token a step on any number of GPUs),
        the pipeline over every GPU (over ``pipeline_gpus`` when the trainer's valid sizes stop
        short of all of them), and two stage switches. No rollout is taken to be shorter than
        the one measured, but for the part of it that was saturated, which spreads over every
        engine too, and the part paced by its requests, whose steps shrink by the share that
        grew with the sequences an engine held (``IterationRecord.paced_on_s``, a lower bound
        of that share): its longest episode ran from its start to its end, and more engines do
        not shorten the parts of it that wait (tool calls, turns) or decode alone, only those
        that waited for a slot or shared an engine. That errs towards the placement the job
        has, which is the no-harm side."""
        n = max(1, record.total_gpus)
        spread = n if pipeline_gpus is None else min(n, max(1, pipeline_gpus))
        unpaced_s = max(0.0, record.rollout_s - record.rollout_saturated_s - record.rollout_paced_s)
        floor = (
            unpaced_s
            + record.paced_on_s(n)
            + min(record.rollout_saturated_gpu_s / n, record.rollout_saturated_s)
        )
        rollout = max(record.rollout_body_gpu_s / n + record.rollout_tail_s, floor)
        return rollout + record.pipeline_gpu_s / spread + self.stage_switches_s(n) + record.idle_s

    def disaggregated_s(
        self, record: IterationRecord, rollout_gpus: int, body_gpus: int | None = None
    ) -> float:
        """The rollout's body on its ``rollout_gpus``, its tail on the engines that keep the
        stragglers while the rest serve the pipeline (after one trainer move), then the pipeline's
        remaining work on every GPU, no less than its last mini-batch. An iteration whose stages
        were timed one after another on a disaggregated split lent nothing between them: it is
        predicted stage by stage (``staged_s``). ``body_gpus``: the GPUs the body's work spreads
        over, where that is not all of ``rollout_gpus`` (a bound: engines added to a batch too
        thin to fill them do not shorten it)."""
        if record.stages and record.placement is Placement.DISAGGREGATED:
            spread = rollout_gpus if body_gpus is None else body_gpus
            return self.staged_s(record, {ComponentKind.ROLLOUT.value: spread})
        n = max(1, record.total_gpus)
        rollout_gpus = min(max(1, rollout_gpus), n)
        body = record.rollout_body_gpu_s / min(max(1, body_gpus or rollout_gpus), n)
        if record.placement is Placement.DISAGGREGATED and record.rollout_tail_s > 0:
            kept = min(record.tail_gpus, float(rollout_gpus))
        else:
            kept = TAIL_GPUS_PRIOR * rollout_gpus
        lend_s = self.cost_model.estimate_s(
            MigrationStrategy.P2P, gpus_moved=max(1, rollout_gpus), recipient_gpus_after=n
        )
        pipeline_gpus = n - rollout_gpus
        during_body = min(record.pipeline_gpu_s, self._overlap_in_body(record, pipeline_gpus, body))
        tail = record.rollout_tail_s
        tail_capacity = pipeline_gpus * min(tail, lend_s) + (n - kept) * max(0.0, tail - lend_s)
        left = max(0.0, record.pipeline_gpu_s - during_body - tail_capacity)
        last_minibatch = record.pipeline_gpu_s / max(1, self.n_minibatches) / n
        after = max(last_minibatch, left / n + (lend_s if left > 0 and tail <= lend_s else 0.0))
        return body + tail + after + record.idle_s

    @staticmethod
    def staged_s(record: IterationRecord, gpus: Mapping[str, int]) -> float:
        """An iteration whose stages ran one after another, each on its own group's GPUs, with
        the GPUs ``gpus`` gives a stage's group kind (the ones it ran on where not given): each
        stage's busy GPU-seconds over its GPUs, plus the idle time. A stage's work is taken to
        spread evenly over its GPUs (data parallel at a fixed global batch); where it does not
        (a decode bound by memory bandwidth, a host short of cores) the split's measured outcome
        says so (``MoveOutcomes``)."""
        return record.idle_s + sum(
            gpu_s / max(1, gpus.get(kind, held)) for kind, (gpu_s, held) in record.stages.items()
        )

    @staticmethod
    def _overlap_in_body(record: IterationRecord, pipeline_gpus: int, body_s: float) -> float:
        """Pipeline work done while the rollout's body runs: what the record saw overlap, scaled
        to this split's pipeline GPU-seconds when it was measured on a disaggregated split; none
        measured colocated (the stages took turns), so then the samples the body finishes are
        taken to arrive evenly and half of the pipeline's capacity over the body is used."""
        if record.placement is Placement.DISAGGREGATED and record.rollout_body_s > 0:
            measured_gpus = record.total_gpus - record.rollout_body_gpu_s / record.rollout_body_s
            if measured_gpus <= 0:
                return 0.0
            rate = record.pipeline_overlap_gpu_s / (measured_gpus * record.rollout_s)
            return rate * pipeline_gpus * body_s
        return 0.5 * pipeline_gpus * body_s

    def predict_s(
        self,
        record: IterationRecord,
        placement: Placement,
        rollout_gpus: int,
        colocated_trainer_gpus: int | None = None,
    ) -> float:
        if placement is Placement.COLOCATED:
            return self.colocated_s(record, colocated_trainer_gpus)
        return self.disaggregated_s(record, rollout_gpus)

    def switch_s(
        self, to: Placement, total_gpus: int, trainer_gpus: int, colocated_trainer_gpus: int | None = None
    ) -> float:
        """The one-off cost of changing placement at a boundary: the trainer's state spreads to
        (or gathers from) the GPUs it spans colocated (every GPU unless its valid sizes stop
        short), and engines start on the GPUs that gain one."""
        colocated = total_gpus if colocated_trainer_gpus is None else min(total_gpus, colocated_trainer_gpus)
        if to is Placement.COLOCATED:
            moved, after = max(1, colocated - trainer_gpus), colocated
        else:
            moved, after = max(1, total_gpus - trainer_gpus), max(1, trainer_gpus)
        return (
            self.cost_model.estimate_s(MigrationStrategy.P2P, gpus_moved=moved, recipient_gpus_after=after)
            + self.cost_model.engine_launch_s()
        )


@dataclass(frozen=True)
class PlacementChoice:
    """The placement for the next iteration and why."""

    placement: Placement
    predicted_s: Mapping[Placement, float]
    switch_s: float
    detail: str

    def changes_from(self, current: Placement) -> bool:
        return self.placement is not current


class Replanner:
    """The choice at each boundary, from what the job measured; its state is the policy's.

    The current placement is predicted to take what its last iteration took. The other one:

    - **measured on this job, and the job is as it was then**: its measured throughput (tokens
      over seconds) applied to the last iteration's tokens; it must save ``margin``. "As it was"
      means the current placement's tail share has not moved by more than ``SHAPE_CHANGE`` since
      its first iteration after the switch: a tail that appears or disappears changes which
      placement wins, so an older measurement of the other one no longer says much;
    - **otherwise**: ``PlacementModel`` on the last record. That prediction crosses from one
      placement's measurements to the other's, so it must save more: the model's own error on
      the last crossing into that placement on this job (``TRIAL_MARGIN_PRIOR`` before one).
    """

    def __init__(self, model: PlacementModel, margin: float) -> None:
        self.model = model
        self.margin = margin
        self.records: dict[Placement, IterationRecord] = {}  # the latest of each placement
        self.first: dict[Placement, IterationRecord] = {}  # each placement's first since it began
        self.last: IterationRecord | None = None
        self.trial_margins: dict[Placement, float] = {}
        self.trial: tuple[Placement, float] | None = None  # a crossing, and the seconds it predicted
        self.switch_measured_s: float | None = None  # the longest switch this job measured
        # The estimated seconds the running iteration lost at its start to bringing lent GPUs home
        # (``choose``'s ``opening_s`` at the boundary that kept its placement; 0 after a switch).
        self.opening_s = 0.0

    def trial_margin(self, placement: Placement) -> float:
        return self.trial_margins.get(placement, TRIAL_MARGIN_PRIOR)

    def learn(self, record: IterationRecord) -> None:
        if self.trial is not None and self.trial[0] is record.placement and self.trial[1] > 0:
            # How far the crossing prediction was off: the margin the next one must clear.
            error = abs(record.duration_s / self.trial[1] - 1.0)
            self.trial_margins[record.placement] = min(
                max(error, TRIAL_MARGIN_BOUNDS[0]), TRIAL_MARGIN_BOUNDS[1]
            )
        self.trial = None
        if self.last is None or self.last.placement is not record.placement:
            self.first[record.placement] = record
        self.records[record.placement] = record
        self.last = record

    def learn_switch(self, seconds: float) -> None:
        self.switch_measured_s = max(seconds, self.switch_measured_s or 0.0)

    def predicted_s(
        self, placement: Placement, rollout_gpus: int, colocated_trainer_gpus: int | None = None
    ) -> tuple[float, bool]:
        """Seconds the next iteration takes under ``placement``, and whether that rests on a
        measurement of it (rather than on the model alone)."""
        last = self.last
        assert last is not None
        if placement is last.placement:
            return last.duration_s, True
        seen = self.records.get(placement)
        since = self.first.get(last.placement)
        unchanged = since is not None and abs(last.tail_share - since.tail_share) <= SHAPE_CHANGE
        if seen is not None and unchanged:
            if seen.tokens > 0 and last.tokens > 0:
                return seen.duration_s * last.tokens / seen.tokens, True
            # No trainer throughput measured (signals too coarse for the iteration): the batch
            # is the same, so the measured duration itself.
            return seen.duration_s, True
        return self.model.predict_s(last, placement, rollout_gpus, colocated_trainer_gpus), False

    def choose(
        self,
        current: Placement,
        rollout_gpus: int,
        trainer_gpus: int,
        *,
        allow_colocated: bool,
        held_because: str = "the job generates ahead",
        colocated_trainer_gpus: int | None = None,
        opening_s: float = 0.0,
    ) -> PlacementChoice | None:
        """The placement for the next iteration, or None with nothing measured yet. Without
        ``allow_colocated`` a disaggregated job stays so, ``held_because`` says why.
        ``colocated_trainer_gpus``: the GPUs the trainer spans when colocated, where its valid
        sizes stop short of all the job's GPUs (None: all of them). ``opening_s``: the seconds
        the next iteration would lose at its start, staying as it is, to bringing GPUs lent
        within this one home. A switch rebuilds the placement instead, so it does not pay them;
        the last iteration's duration carries its own opening (``self.opening_s``), which the
        next one's replaces: the first iteration had none, and its successors' will."""
        record = self.last
        if record is None:
            return None
        other = Placement.DISAGGREGATED if current is Placement.COLOCATED else Placement.COLOCATED
        stay, _ = self.predicted_s(current, rollout_gpus, colocated_trainer_gpus)
        stay = max(0.0, stay - self.opening_s) + opening_s
        move, measured = self.predicted_s(other, rollout_gpus, colocated_trainer_gpus)
        predicted = {current: stay, other: move}
        switch = self.model.switch_s(other, record.total_gpus, trainer_gpus, colocated_trainer_gpus)
        switch_basis = ""
        if self.switch_measured_s is not None and self.switch_measured_s > switch:
            switch, switch_basis = self.switch_measured_s, " (as measured on this job)"
        margin = self.margin if measured else max(self.margin, self.trial_margin(other))
        basis = "its measured throughput on this job" if measured else "modelled from this iteration"
        opening = f" (and {opening_s:.1f}s to bring its lent GPUs home, staying)" if opening_s >= 0.05 else ""
        summary = (
            f"iteration {record.iteration} ({record.placement}) took {seconds(record.duration_s)}s{opening}: "
            f"rollout body {seconds(record.rollout_body_s)}s, tail {seconds(record.rollout_tail_s)}s, pipeline "
            f"{seconds(record.pipeline_gpu_s)} GPU-s; {other} predicted {seconds(move)}s ({basis})"
        )
        # Taken as kept until a switch is chosen (a caller that cannot carry one out sets it back).
        self.opening_s = opening_s
        if other is Placement.COLOCATED and not allow_colocated:
            return PlacementChoice(current, predicted, 0.0, f"{summary}; {current} stays: {held_because}")
        # The saving must clear the margin (the prediction's noise) and pay the one-off switch
        # back within PAYBACK_ITERATIONS iterations.
        saving = stay - move
        if saving > margin * stay and PAYBACK_ITERATIONS * saving > switch:
            if not measured:
                self.trial = (other, move)
            self.opening_s = 0.0
            return PlacementChoice(
                other,
                predicted,
                switch,
                f"{summary}: {other} saves {seconds(stay - move)}s of {seconds(stay)}s for a {switch:.1f}s switch"
                f"{switch_basis} (needs {margin:.0%})",
            )
        why = f"a switch needs {margin:.0%}"
        if saving > margin * stay:
            why = (
                f"saving {seconds(saving)}s an iteration does not pay a {switch:.1f}s switch{switch_basis} "
                f"back within {PAYBACK_ITERATIONS} iterations"
            )
        return PlacementChoice(current, predicted, 0.0, f"{summary}: {current} stays ({why})")

    def to_json(self) -> dict[str, Any]:
        return {
            "records": {mode.value: record.to_json() for mode, record in self.records.items()},
            "first": {mode.value: record.to_json() for mode, record in self.first.items()},
            "last": self.last.to_json() if self.last is not None else None,
            "trial_margins": {mode.value: value for mode, value in self.trial_margins.items()},
            "trial": [self.trial[0].value, self.trial[1]] if self.trial is not None else None,
            "switch_measured_s": self.switch_measured_s,
            "opening_s": self.opening_s,
        }

    def load(self, data: Mapping[str, Any]) -> None:
        self.records = {
            Placement(k): IterationRecord.from_json(v) for k, v in data.get("records", {}).items()
        }
        self.first = {Placement(k): IterationRecord.from_json(v) for k, v in data.get("first", {}).items()}
        last = data.get("last")
        self.last = IterationRecord.from_json(last) if last else None
        self.trial_margins = {Placement(k): float(v) for k, v in data.get("trial_margins", {}).items()}
        trial = data.get("trial")
        self.trial = (Placement(trial[0]), float(trial[1])) if trial else None
        switch = data.get("switch_measured_s")
        self.switch_measured_s = None if switch is None else float(switch)
        self.opening_s = float(data.get("opening_s", 0.0))


def seconds(value: float) -> str:
    """Seconds for the decision trail: a tenth under ten (real iterations of a few seconds),
    whole ones above."""
    return f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"


def busy_gpu_s(record: IterationRecord, kind: ComponentKind) -> float:
    """GPU-seconds a pipeline group kind was busy in a ticks' record."""
    if kind is ComponentKind.INFERENCE:
        return record.log_prob_gpu_s
    if kind is ComponentKind.ACTOR:
        return max(0.0, record.pipeline_gpu_s - record.log_prob_gpu_s)
    return 0.0


def work(record: IterationRecord) -> float:
    """An iteration's work as a disaggregated split does it: the rollout body's and the
    pipeline's GPU-seconds (for comparing iterations of one placement)."""
    return record.rollout_body_gpu_s + record.pipeline_gpu_s
