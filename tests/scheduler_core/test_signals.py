from typing import Any

import pytest

from scheduler.core.hypergraph import ComponentKind, Device, Hypergraph, HyperNode, Worker
from scheduler.core.signal_window import SignalAggregator, quantile
from scheduler.core.signals import GroupSignals, WorkerSample


def _sample(worker: str, at: float, utilisation: float, group: str = "rollout", **extra: Any) -> WorkerSample:
    return WorkerSample(group_id=group, worker_id=worker, at=at, utilisation=utilisation, **extra)


def _feed(
    agg: SignalAggregator, worker: str, start: float, end: float, utilisation: float, **extra: Any
) -> None:
    """One sample per second in [start, end]."""
    t = start
    while t <= end + 1e-9:
        agg.add(_sample(worker, t, utilisation, **extra))
        t += 1.0


def test_quantile_interpolates() -> None:
    values = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert quantile(values, 0.5) == 2.0
    assert quantile(values, 0.9) == pytest.approx(3.6)
    assert quantile(values, 1.0) == 4.0
    assert quantile([], 0.5) == 0.0
    assert quantile([7.0], 0.99) == 7.0


def test_mean_and_quantiles_over_all_samples_in_window() -> None:
    agg = SignalAggregator(window_s=10.0)
    # w0 reports 0.1 ten times, w1 reports 0.9 ten times: 20 samples in the window.
    _feed(agg, "w0", 91, 100, 0.1)
    _feed(agg, "w1", 91, 100, 0.9)
    signals = agg.group_signals("rollout", 100.0)
    assert signals.workers == 2
    assert signals.utilisation_mean == pytest.approx(0.5)
    assert signals.utilisation_p50 == pytest.approx(0.5)  # midway between the 10th and 11th value
    assert signals.utilisation_p90 == pytest.approx(0.9)
    assert signals.utilisation_p99 == pytest.approx(0.9)


def test_window_expiry_drops_old_samples() -> None:
    agg = SignalAggregator(window_s=10.0)
    _feed(agg, "w0", 81, 90, 0.9)  # old and busy
    _feed(agg, "w0", 91, 100, 0.1)  # the last 10 s idle
    assert agg.group_signals("rollout", 100.0).utilisation_mean == pytest.approx(0.1)
    # At t=95 half the window is the busy period.
    agg2 = SignalAggregator(window_s=10.0)
    _feed(agg2, "w0", 81, 90, 0.9)
    _feed(agg2, "w0", 91, 95, 0.1)
    assert agg2.group_signals("rollout", 95.0).utilisation_mean == pytest.approx(0.5)
    # The left edge is open: a sample exactly window_s old is out.
    agg3 = SignalAggregator(window_s=10.0)
    agg3.add(_sample("w0", 90.0, 1.0))
    agg3.add(_sample("w0", 100.0, 0.0))
    assert agg3.group_signals("rollout", 100.0).utilisation_mean == 0.0


def test_memory_is_bounded_to_the_window() -> None:
    agg = SignalAggregator(window_s=10.0)
    _feed(agg, "w0", 0, 1000, 0.5)
    assert len(agg._workers["w0"].samples) <= 11
    # A worker that went silent is swept once a whole window passed.
    _feed(agg, "w1", 1001, 1030, 0.5)
    assert "w0" not in agg._workers


def test_whole_window_rule() -> None:
    agg = SignalAggregator(window_s=10.0, u_low=0.2)
    _feed(agg, "old", 80, 100, 0.05)  # idle for longer than the window
    _feed(agg, "young", 95, 100, 0.0)  # idle, but only started 5 s ago
    _feed(agg, "busy", 80, 100, 0.9)
    _feed(agg, "blip", 80, 100, 0.05)
    agg.add(_sample("blip", 97.5, 0.3))  # one sample above u_low inside the window
    signals = agg.group_signals("rollout", 100.0)
    assert signals.low_utilisation_workers == ("old",)
    assert signals.low_utilisation_fraction == pytest.approx(1 / 4)


def test_whole_window_rule_tolerates_one_sample_period() -> None:
    agg = SignalAggregator(window_s=10.0, u_low=0.2)
    # Sampled at x.5: the first sample inside (90, 100] is at 90.5.
    _feed(agg, "a", 80.5, 99.5, 0.0)
    # First sample at 92.0: two periods late, so it did not cover the window.
    _feed(agg, "b", 92.0, 100.0, 0.0)
    signals = agg.group_signals("rollout", 100.0)
    assert signals.low_utilisation_workers == ("a",)


def test_low_workers_sorted_lowest_first() -> None:
    agg = SignalAggregator(window_s=10.0, u_low=0.5)
    _feed(agg, "w-high", 85, 100, 0.4)
    _feed(agg, "w-low", 85, 100, 0.05)
    _feed(agg, "w-mid", 85, 100, 0.2)
    signals = agg.group_signals("rollout", 100.0)
    assert signals.low_utilisation_workers == ("w-low", "w-mid", "w-high")
    assert signals.low_utilisation_fraction == 1.0


def test_worker_that_left_the_group_is_ignored() -> None:
    agg = SignalAggregator(window_s=10.0)
    _feed(agg, "stays", 85, 100, 0.8, queue_length=3, in_flight=4)
    _feed(agg, "left", 85, 100, 0.0, queue_length=100, in_flight=100)
    signals = agg.group_signals("rollout", 100.0, worker_ids=["stays", "new"])
    assert signals.workers == 2  # "new" has no samples yet but is a member
    assert signals.utilisation_mean == pytest.approx(0.8)
    assert signals.queue_length == 3
    assert signals.in_flight == 4
    assert signals.low_utilisation_workers == ()


def test_samples_of_another_group_are_ignored() -> None:
    agg = SignalAggregator(window_s=10.0)
    _feed(agg, "w0", 91, 100, 0.8)
    agg.add(_sample("a0", 100, 0.3, group="actor"))
    assert agg.group_signals("rollout", 100.0, worker_ids=["w0", "a0"]).utilisation_mean == pytest.approx(0.8)


def test_queue_in_flight_from_latest_sample_and_tokens_rate() -> None:
    agg = SignalAggregator(window_s=10.0)
    for t in range(91, 101):
        agg.add(_sample("w0", t, 0.5, queue_length=t - 90, in_flight=2, tokens=100))
        agg.add(_sample("w1", t, 0.5, queue_length=1, in_flight=t - 90, tokens=50))
    signals = agg.group_signals("rollout", 100.0, max_in_flight_per_worker=8)
    assert signals.queue_length == 10 + 1
    assert signals.in_flight == 2 + 10
    assert signals.max_in_flight_per_worker == 8
    # 10 samples a second apart cover 10 s: 1000 + 500 tokens.
    assert signals.tokens_per_s == pytest.approx(150.0)


def test_tokens_rate_of_a_group_that_just_started() -> None:
    agg = SignalAggregator(window_s=10.0)
    for t in range(96, 101):  # 5 samples, the first one's tokens were made in (95, 96]
        agg.add(_sample("w0", t, 0.5, tokens=100))
    assert agg.group_signals("rollout", 100.0).tokens_per_s == pytest.approx(100.0)


def test_progress_and_busy() -> None:
    agg = SignalAggregator(window_s=10.0)
    agg.add(_sample("w0", 95, 0.5, progress=0.4))
    agg.add(_sample("w0", 96, 0.5))  # no progress reported: the last reported one stands
    agg.add(_sample("w1", 96, 0.0, progress=0.6))
    signals = agg.group_signals("rollout", 100.0)
    assert signals.progress == pytest.approx(0.6)
    assert signals.busy


def test_idle_group_is_not_busy() -> None:
    agg = SignalAggregator(window_s=10.0)
    agg.add(_sample("w0", 95, 0.7, in_flight=3))
    agg.add(_sample("w0", 96, 0.0))  # latest: nothing running, nothing queued
    assert not agg.group_signals("rollout", 100.0).busy
    agg.add(_sample("w0", 97, 0.0, queue_length=1))
    assert agg.group_signals("rollout", 100.0).busy


def test_group_without_samples_gives_zeros() -> None:
    agg = SignalAggregator()
    signals = agg.group_signals("nobody", 50.0, worker_ids=["a", "b"])
    assert signals == GroupSignals(group_id="nobody", at=50.0, window_s=10.0, workers=2, busy=False)
    # Samples that all expired count as none.
    agg.add(_sample("a", 10.0, 0.9, group="nobody"))
    assert agg.group_signals("nobody", 50.0, worker_ids=["a"]).busy is False


def test_repeated_sample_is_not_counted_twice() -> None:
    agg = SignalAggregator(window_s=10.0)
    agg.add(_sample("w0", 99, 0.5, tokens=100))
    agg.add(_sample("w0", 100, 0.5, tokens=100))
    agg.add(_sample("w0", 99, 0.5, tokens=100))  # retransmitted
    agg.add(_sample("w0", 98, 0.1, tokens=100))  # late, out of order
    samples = agg._workers["w0"].samples
    assert [s.at for s in samples] == [98, 99, 100]
    assert agg.group_signals("rollout", 100.0).utilisation_mean == pytest.approx(1.1 / 3)


def test_forget_worker() -> None:
    agg = SignalAggregator(window_s=10.0)
    _feed(agg, "w0", 91, 100, 0.5)
    _feed(agg, "w1", 91, 100, 0.1)
    agg.forget_worker("w0")
    agg.forget_worker("never-seen")
    signals = agg.group_signals("rollout", 100.0)
    assert signals.workers == 1
    assert signals.utilisation_mean == pytest.approx(0.1)


def test_all_signals_uses_graph_membership() -> None:
    def node(group: str, kind: ComponentKind, workers: list[str]) -> HyperNode:
        return HyperNode(
            id=group,
            kind=kind,
            workers=tuple(
                Worker(id=w, devices=(Device(id=f"{w}-d", node="n", hardware="H100"),)) for w in workers
            ),
        )

    graph = Hypergraph(
        job_id="j",
        nodes=(
            node("rollout", ComponentKind.ROLLOUT, ["r0", "r1"]),
            node("actor", ComponentKind.ACTOR, ["a0"]),
        ),
    )
    agg = SignalAggregator(window_s=10.0)
    _feed(agg, "r0", 85, 100, 0.05)
    _feed(agg, "r1", 85, 100, 0.9)
    _feed(agg, "r-gone", 85, 100, 0.0)
    _feed(agg, "a0", 85, 100, 1.0, group="actor")
    signals = agg.all_signals(graph, 100.0, max_in_flight_per_worker={"rollout": 64})
    assert set(signals) == {"rollout", "actor"}
    assert signals["rollout"].workers == 2
    assert signals["rollout"].low_utilisation_fraction == pytest.approx(0.5)
    assert signals["rollout"].max_in_flight_per_worker == 64
    assert signals["actor"].utilisation_mean == pytest.approx(1.0)
    assert signals["actor"].max_in_flight_per_worker == 0


def test_signals_json_round_trip() -> None:
    agg = SignalAggregator(window_s=10.0)
    _feed(agg, "w0", 85, 100, 0.05, progress=0.3)
    signals = agg.group_signals("rollout", 100.0)
    assert GroupSignals.from_json(signals.to_json()) == signals


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        SignalAggregator(window_s=0)
    with pytest.raises(ValueError):
        SignalAggregator(sample_period_s=0)


def test_query_about_the_past_ignores_later_samples() -> None:
    agg = SignalAggregator(window_s=10.0)
    _feed(agg, "w0", 91, 95, 0.1, tokens=10, in_flight=1)
    _feed(agg, "w0", 96, 100, 0.9, tokens=10, in_flight=7)
    past = agg.group_signals("rollout", 95.0)
    assert past.utilisation_mean == pytest.approx(0.1)
    assert past.in_flight == 1
    assert past.tokens_per_s == pytest.approx(10.0)  # 50 tokens over (90, 95]
    assert agg.group_signals("rollout", 100.0).utilisation_mean == pytest.approx(0.5)
    assert agg.group_signals("rollout", 90.5).busy is False  # nothing at or before 90.5
