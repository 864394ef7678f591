"""Throughput of each WorkerGroup as a function of its GPUs, and the job throughput built from it.

Model: per group, ``T(g) = a * g**b`` tokens/s on ``g`` GPUs, worked in log space
(``log T = log a + b log g``):

1. The prior is the least-squares fit of the group's profile points (looked up by group id,
   then by component kind value). With no profile it is "one unit per GPU" with the kind's
   default exponent (1.0 for static components, whose throughput grows about linearly; 0.8 for
   dynamic ones, whose returns diminish), so comparisons degrade to GPU counts, never fail.
2. Online samples correct the prior by a level shift ``c`` and an exponent shift ``d`` around
   the samples' mean size, both by weighted least squares. The newest sample weighs 1 and older
   ones halve every ``recency_half_life`` samples, so the curve follows the job as it drifts. The
   profile counts as ``prior_weight`` samples older than the first one (it ages like them): one
   or two samples cannot swing the curve, a steady stream of them takes over. The exponent
   only moves as far as the samples' own spread of sizes supports.
3. The exponent is kept within [0, 1.25]: more GPUs never lower throughput, and nothing scales
   much better than linearly.

Every prediction a caller wants audited is recorded under a key (``record_prediction``) and later
closed with what happened (``record_observation``); ``errors`` and ``mape`` report the accuracy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from scheduler.core.hypergraph import DEFAULT_SCALING, ComponentKind, Hypergraph, HyperNode, Scaling

DEFAULT_EXPONENT: Mapping[Scaling, float] = {Scaling.STATIC: 1.0, Scaling.DYNAMIC: 0.8}
# Throughput never falls when GPUs are added, and no component scales much better than linearly.
MIN_EXPONENT = 0.0
MAX_EXPONENT = 1.25
# Weighted spread of log sizes under which points count as one size (no exponent information).
SAME_SIZE_SPREAD = 1e-9


class JobModel(StrEnum):
    """How stage throughputs combine into the job's throughput (see ``predict_job``)."""

    PIPELINED = "pipelined"  # stages run at once, each on its own GPUs: the slowest stage sets the pace
    SEQUENTIAL = "sequential"  # stages take turns: per-token times add up along the critical path


@dataclass(frozen=True)
class ThroughputSample:
    gpus: float
    tokens_per_s: float
    at: float


@dataclass(frozen=True)
class PowerLawFit:
    """``T(g) = scale * g ** exponent`` tokens/s."""

    scale: float
    exponent: float
    points: int  # profile points + samples behind the fit

    def __call__(self, gpus: float) -> float:
        if gpus <= 0:
            return 0.0
        return self.scale * math.pow(gpus, self.exponent)


@dataclass(frozen=True)
class PredictionRecord:
    """One audited prediction and, once known, what was observed."""

    key: str
    group_id: str
    predicted: float
    predicted_at: float
    observed: float | None = None
    observed_at: float | None = None

    @property
    def abs_error(self) -> float | None:
        if self.observed is None:
            return None
        return abs(self.predicted - self.observed)

    @property
    def relative_error(self) -> float | None:
        """|predicted - observed| / observed, as a fraction; None while unobserved or observed is 0."""
        if self.observed is None or self.observed == 0:
            return None
        return abs(self.predicted - self.observed) / abs(self.observed)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "group_id": self.group_id,
            "predicted": self.predicted,
            "predicted_at": self.predicted_at,
            "observed": self.observed,
            "observed_at": self.observed_at,
            "abs_error": self.abs_error,
            "relative_error": self.relative_error,
        }


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _validated_profile(key: str, points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    cleaned: list[tuple[float, float]] = []
    for gpus, tokens_per_s in points:
        _check_finite(f"profile {key!r} gpus", gpus)
        _check_finite(f"profile {key!r} tokens_per_s", tokens_per_s)
        if gpus <= 0 or tokens_per_s <= 0:
            raise ValueError(
                f"profile {key!r} points need gpus > 0 and tokens_per_s > 0, got {(gpus, tokens_per_s)}"
            )
        cleaned.append((float(gpus), float(tokens_per_s)))
    return tuple(cleaned)


def fit_power_law(points: Sequence[tuple[float, float, float]], *, default_exponent: float) -> PowerLawFit:
    """Weighted least squares of ``log T = log a + b log g`` over (gpus, tokens/s, weight) points.

    Points all at one size cannot tell the exponent: it is then ``default_exponent``. The
    exponent is clamped to [MIN_EXPONENT, MAX_EXPONENT].
    """
    usable = [(math.log(g), math.log(t), w) for g, t, w in points if g > 0 and t > 0 and w > 0]
    total_weight = sum(w for _, _, w in usable)
    if total_weight <= 0:
        return PowerLawFit(scale=1.0, exponent=default_exponent, points=0)
    mean_x = sum(w * x for x, _, w in usable) / total_weight
    mean_y = sum(w * y for _, y, w in usable) / total_weight
    sxx = sum(w * (x - mean_x) ** 2 for x, _, w in usable)
    sxy = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in usable)
    exponent = sxy / sxx if sxx > SAME_SIZE_SPREAD else default_exponent
    exponent = min(MAX_EXPONENT, max(MIN_EXPONENT, exponent))
    log_scale = mean_y - exponent * mean_x
    return PowerLawFit(scale=math.exp(log_scale), exponent=exponent, points=len(usable))


class ThroughputPredictor:
    """Per-group throughput curves from profiles refined online, plus prediction-error accounting.

    ``profiles`` maps a group id or a component kind value to (gpus, tokens/s) points.
    """

    def __init__(
        self,
        profiles: Mapping[str, Sequence[tuple[float, float]]] | None = None,
        *,
        prior_weight: float = 3.0,
        recency_half_life: float = 8.0,
        max_samples: int = 256,
    ) -> None:
        if prior_weight < 0 or not math.isfinite(prior_weight):
            raise ValueError(f"prior_weight must be a finite number >= 0, got {prior_weight!r}")
        if recency_half_life <= 0:
            raise ValueError(f"recency_half_life must be positive, got {recency_half_life!r}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be at least 1, got {max_samples!r}")
        self.prior_weight = prior_weight
        self.recency_half_life = recency_half_life
        self.max_samples = max_samples
        self._profiles: dict[str, tuple[tuple[float, float], ...]] = {
            key: _validated_profile(key, points) for key, points in (profiles or {}).items()
        }
        self._samples: dict[str, deque[ThroughputSample]] = {}
        self._fits: dict[tuple[str, ComponentKind], PowerLawFit] = {}
        self._records: dict[str, PredictionRecord] = {}

    # -- the curves ------------------------------------------------------------------------

    def set_profile(self, key: str, points: Sequence[tuple[float, float]]) -> None:
        """Seed (or replace) the profile of a group id or a kind value."""
        self._profiles[key] = _validated_profile(key, points)
        self._fits.clear()

    def profile(self, group_id: str, kind: ComponentKind) -> tuple[tuple[float, float], ...]:
        """The profile a group uses: its own, else its kind's, else none."""
        return self._profiles.get(group_id) or self._profiles.get(kind.value) or ()

    def samples(self, group_id: str) -> tuple[ThroughputSample, ...]:
        return tuple(self._samples.get(group_id, ()))

    def observe(
        self, group_id: str, kind: ComponentKind, gpus: float, tokens_per_s: float, at: float
    ) -> None:
        """Record what a group achieved on ``gpus`` GPUs.

        Zero throughput or zero GPUs is ignored: it means the group had nothing to do (or held
        nothing), which says nothing about what its GPUs can deliver.
        """
        _check_finite("gpus", gpus)
        _check_finite("tokens_per_s", tokens_per_s)
        _check_finite("at", at)
        if gpus < 0 or tokens_per_s < 0:
            raise ValueError(f"gpus and tokens_per_s must be >= 0, got {gpus!r} and {tokens_per_s!r}")
        if gpus == 0 or tokens_per_s == 0:
            return
        window = self._samples.get(group_id)
        if window is None:
            window = deque(maxlen=self.max_samples)
            self._samples[group_id] = window
        window.append(ThroughputSample(gpus=float(gpus), tokens_per_s=float(tokens_per_s), at=float(at)))
        self._fits.pop((group_id, kind), None)

    def fit(self, group_id: str, kind: ComponentKind) -> PowerLawFit:
        cached = self._fits.get((group_id, kind))
        if cached is not None:
            return cached
        default_exponent = DEFAULT_EXPONENT[DEFAULT_SCALING[kind]]
        profile = self.profile(group_id, kind)
        prior = fit_power_law([(g, t, 1.0) for g, t in profile], default_exponent=default_exponent)
        samples = self._samples.get(group_id, ())
        if not samples:
            self._fits[(group_id, kind)] = prior
            return prior
        newest = len(samples) - 1
        weights = [0.5 ** ((newest - i) / self.recency_half_life) for i in range(len(samples))]
        xs = [math.log(s.gpus) for s in samples]
        residuals = [math.log(s.tokens_per_s) - math.log(prior(s.gpus)) for s in samples]
        total = sum(weights)
        mean_x = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
        sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs, strict=True))
        if profile:
            # The profile ages like a sample recorded just before the first one.
            prior_weight = self.prior_weight * 0.5 ** (len(samples) / self.recency_half_life)
            profile_xs = [math.log(g) for g, _ in profile]
            profile_mean = sum(profile_xs) / len(profile_xs)
            profile_spread = sum((x - profile_mean) ** 2 for x in profile_xs) / len(profile_xs)
            slope_prior = prior_weight * profile_spread
        else:
            prior_weight = 0.0
            slope_prior = 0.0
        level = sum(w * r for w, r in zip(weights, residuals, strict=True)) / (total + prior_weight)
        slope = 0.0
        if sxx + slope_prior > SAME_SIZE_SPREAD:
            covariance = sum(w * (x - mean_x) * r for w, x, r in zip(weights, xs, residuals, strict=True))
            slope = covariance / (sxx + slope_prior)
        exponent = min(MAX_EXPONENT, max(MIN_EXPONENT, prior.exponent + slope))
        # log T(x) = log a0 + b0 x + level + slope (x - mean_x), refolded into a power law.
        log_scale = math.log(prior.scale) + level - (exponent - prior.exponent) * mean_x
        fitted = PowerLawFit(scale=math.exp(log_scale), exponent=exponent, points=len(profile) + len(samples))
        self._fits[(group_id, kind)] = fitted
        return fitted

    def predict(self, group_id: str, kind: ComponentKind, gpus: float) -> float:
        """Predicted tokens/s of the group on ``gpus`` GPUs (0 for no GPUs)."""
        if gpus <= 0:
            return 0.0
        return self.fit(group_id, kind)(gpus)

    def predict_node(self, node: HyperNode, gpus: float | None = None) -> float:
        return self.predict(node.id, node.kind, node.gpus if gpus is None else gpus)

    def predict_job(
        self,
        graph: Hypergraph,
        allocation: Mapping[str, int] | None = None,
        *,
        model: JobModel = JobModel.PIPELINED,
    ) -> float:
        """Job tokens/s for ``allocation`` (group id -> GPUs; groups left out keep what they hold).

        Every stage processes the same tokens once per iteration (rollout generates them, the
        log-prob and training stages consume them), so stage rates are comparable.

        - ``PIPELINED`` (disaggregated placement): all stages run concurrently on their own GPUs,
          so the job runs at the slowest stage's pace: the minimum over stages (DynaRL's
          approximation). A stage is a component kind; groups of one kind share its work, so
          their rates add up. Dependencies do not change a minimum, so they are not consulted.
        - ``SEQUENTIAL`` (colocated time-sharing): stages take turns, so per-token times add up
          along dependency chains; groups on parallel branches overlap, hence the job runs at
          1 / (the longest path of per-token times) over the dependency graph (``depends_on``
          plus the hyperedges).

        Groups that hold no GPUs and are given none (CPU-side reward or tool groups) are left out;
        a group that holds GPUs and is given none stops the job (0 tokens/s).
        """
        allocation = allocation or {}
        rates: dict[str, float] = {}
        for node in graph.nodes:
            gpus = allocation.get(node.id, node.gpus)
            if gpus <= 0 and node.gpus <= 0:
                continue
            rates[node.id] = self.predict(node.id, node.kind, gpus)
        if not rates:
            return 0.0
        if min(rates.values()) <= 0:
            return 0.0
        if model is JobModel.PIPELINED:
            stages: dict[ComponentKind, float] = {}
            for node in graph.nodes:
                if node.id in rates:
                    stages[node.kind] = stages.get(node.kind, 0.0) + rates[node.id]
            return min(stages.values())
        seconds_per_token = {group_id: 1.0 / rate for group_id, rate in rates.items()}
        longest = _longest_path(graph, seconds_per_token)
        return 1.0 / longest if longest > 0 else 0.0

    # -- error accounting ------------------------------------------------------------------

    def record_prediction(self, key: str, group_id: str, predicted: float, at: float) -> PredictionRecord:
        """Remember a prediction to be checked later. Re-recording an open key replaces it
        (a retried tick); re-recording a key already observed is an error."""
        _check_finite("predicted", predicted)
        existing = self._records.get(key)
        if existing is not None and existing.observed is not None:
            raise ValueError(f"prediction {key!r} was already observed")
        record = PredictionRecord(key=key, group_id=group_id, predicted=float(predicted), predicted_at=at)
        self._records[key] = record
        return record

    def record_observation(self, key: str, observed: float, at: float) -> PredictionRecord:
        """Close a prediction with what happened; raises KeyError for an unknown key."""
        _check_finite("observed", observed)
        record = replace(self._records[key], observed=float(observed), observed_at=at)
        self._records[key] = record
        return record

    def pending(self) -> list[PredictionRecord]:
        return [r for r in self._records.values() if r.observed is None]

    def errors(self) -> list[PredictionRecord]:
        """Observed predictions, in the order they were recorded."""
        return [r for r in self._records.values() if r.observed is not None]

    def mape(self, group_id: str | None = None) -> float | None:
        """Mean absolute percentage error (in percent) over observed predictions, or None if none."""
        relative = [
            r.relative_error
            for r in self.errors()
            if r.relative_error is not None and (group_id is None or r.group_id == group_id)
        ]
        if not relative:
            return None
        return 100.0 * sum(relative) / len(relative)


def _longest_path(graph: Hypergraph, cost: Mapping[str, float]) -> float:
    """Longest path (sum of node costs) through the dependency DAG restricted to ``cost``'s groups."""
    parents: dict[str, set[str]] = {group_id: set() for group_id in cost}
    for node in graph.nodes:
        if node.id in parents:
            parents[node.id].update(dep for dep in node.depends_on if dep in cost and dep != node.id)
    for edge in graph.edges:
        if edge.target in parents and edge.source in cost and edge.source != edge.target:
            parents[edge.target].add(edge.source)
    finish: dict[str, float] = {}
    visiting: set[str] = set()

    def finish_time(group_id: str) -> float:
        if group_id in finish:
            return finish[group_id]
        if group_id in visiting:
            raise _CycleError
        visiting.add(group_id)
        before = max((finish_time(p) for p in parents[group_id]), default=0.0)
        visiting.discard(group_id)
        finish[group_id] = before + cost[group_id]
        return finish[group_id]

    try:
        return max(finish_time(group_id) for group_id in cost)
    except _CycleError:
        # A cycle (a misdeclared job) has no critical path; every stage then counts once.
        return sum(cost.values())


class _CycleError(Exception):
    pass
