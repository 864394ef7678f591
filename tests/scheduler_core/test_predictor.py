import math

import pytest

from scheduler.core.hypergraph import ComponentKind, Device, Hypergraph, HyperNode, Worker
from scheduler.core.predictor import JobModel, ThroughputPredictor, fit_power_law

ROLLOUT = ComponentKind.ROLLOUT
ACTOR = ComponentKind.ACTOR


def power_profile(
    scale: float, exponent: float, sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
) -> list[tuple[float, float]]:
    return [(g, scale * g**exponent) for g in sizes]


def node(group_id: str, kind: ComponentKind, gpus: int, depends_on: tuple[str, ...] = ()) -> HyperNode:
    workers = tuple(
        Worker(id=f"{group_id}-w{i}", devices=(Device(f"{group_id}-d{i}", "n0", "H100"),))
        for i in range(gpus)
    )
    return HyperNode(id=group_id, kind=kind, workers=workers, depends_on=depends_on)


def test_fits_the_profile_and_interpolates_between_points():
    predictor = ThroughputPredictor({"rollout": power_profile(1000.0, 0.8)})
    for gpus in (1, 4, 16):
        assert predictor.predict("r0", ROLLOUT, gpus) == pytest.approx(1000.0 * gpus**0.8, rel=1e-6)
    assert predictor.predict("r0", ROLLOUT, 6) == pytest.approx(1000.0 * 6**0.8, rel=1e-6)
    assert predictor.fit("r0", ROLLOUT).exponent == pytest.approx(0.8, abs=1e-6)


def test_group_profile_wins_over_the_kind_profile():
    predictor = ThroughputPredictor({"rollout": power_profile(1000.0, 0.8), "r1": power_profile(10.0, 1.0)})
    assert predictor.predict("r1", ROLLOUT, 4) == pytest.approx(40.0, rel=1e-6)
    assert predictor.predict("r0", ROLLOUT, 4) == pytest.approx(1000.0 * 4**0.8, rel=1e-6)


def test_without_profile_or_samples_it_falls_back_to_one_unit_per_gpu():
    predictor = ThroughputPredictor()
    assert predictor.predict("a", ACTOR, 8) == pytest.approx(8.0)  # static: linear
    assert predictor.predict("r", ROLLOUT, 8) == pytest.approx(8.0**0.8)  # dynamic: diminishing
    assert predictor.predict("a", ACTOR, 0) == 0.0


def test_online_samples_refine_the_curve():
    predictor = ThroughputPredictor({"actor": power_profile(100.0, 1.0)})
    assert predictor.predict("a", ACTOR, 8) == pytest.approx(800.0, rel=1e-6)
    for t in range(30):
        predictor.observe("a", ACTOR, 8, 1200.0, at=float(t))
    assert predictor.predict("a", ACTOR, 8) == pytest.approx(1200.0, rel=0.05)


def test_the_prior_dampens_a_single_outlier():
    damped = ThroughputPredictor({"actor": power_profile(100.0, 1.0)}, prior_weight=3.0)
    undamped = ThroughputPredictor({"actor": power_profile(100.0, 1.0)}, prior_weight=0.0)
    for predictor in (damped, undamped):
        predictor.observe("a", ACTOR, 8, 1600.0, at=1.0)  # twice the profile
    moved = damped.predict("a", ACTOR, 8)
    assert 800.0 < moved < 800.0 * 1.3
    assert undamped.predict("a", ACTOR, 8) == pytest.approx(1600.0, rel=1e-6)


def test_recent_samples_weigh_more_than_old_ones():
    predictor = ThroughputPredictor(recency_half_life=4.0)
    for t in range(20):
        predictor.observe("a", ACTOR, 4, 400.0, at=float(t))
    for t in range(20, 30):
        predictor.observe("a", ACTOR, 4, 800.0, at=float(t))
    # An unweighted fit would land on the geometric mean weighted 2:1 towards 400 (~504).
    assert predictor.predict("a", ACTOR, 4) > 700.0


def test_idle_observations_are_ignored_and_bad_ones_rejected():
    predictor = ThroughputPredictor({"actor": power_profile(100.0, 1.0)})
    predictor.observe("a", ACTOR, 8, 0.0, at=1.0)
    predictor.observe("a", ACTOR, 0, 500.0, at=1.0)
    assert predictor.samples("a") == ()
    with pytest.raises(ValueError, match="tokens_per_s"):
        predictor.observe("a", ACTOR, 8, -1.0, at=1.0)
    with pytest.raises(ValueError, match="gpus"):
        predictor.observe("a", ACTOR, math.nan, 1.0, at=1.0)


def test_bad_profiles_and_settings_are_rejected():
    with pytest.raises(ValueError, match="profile 'actor'"):
        ThroughputPredictor({"actor": [(0, 100.0)]})
    with pytest.raises(ValueError, match="prior_weight"):
        ThroughputPredictor(prior_weight=-1.0)


def test_exponent_is_clamped_to_non_decreasing_throughput():
    fit = fit_power_law([(1, 100.0, 1.0), (8, 10.0, 1.0)], default_exponent=1.0)
    assert fit.exponent == 0.0


def test_job_throughput_pipelined_is_the_slowest_stage():
    predictor = ThroughputPredictor({"rollout": [(1, 300.0), (2, 600.0)], "actor": [(1, 100.0), (2, 200.0)]})
    graph = Hypergraph(job_id="j", nodes=(node("r", ROLLOUT, 4), node("a", ACTOR, 2, ("r",))))
    assert predictor.predict_job(graph) == pytest.approx(200.0, rel=1e-6)
    # Moving GPUs to the actor makes the rollout the slowest stage.
    assert predictor.predict_job(graph, {"r": 1, "a": 5}) == pytest.approx(300.0, rel=1e-6)
    assert predictor.predict_job(graph, {"a": 0}) == 0.0


def test_groups_of_one_kind_share_their_stage():
    predictor = ThroughputPredictor({"rollout": [(1, 300.0), (2, 600.0)], "actor": [(1, 100.0), (2, 200.0)]})
    graph = Hypergraph(
        job_id="j", nodes=(node("r1", ROLLOUT, 1), node("r2", ROLLOUT, 1), node("a", ACTOR, 8, ("r1", "r2")))
    )
    assert predictor.predict_job(graph) == pytest.approx(600.0, rel=1e-6)  # 300 + 300 < 800


def test_job_throughput_sequential_adds_times_along_the_critical_path():
    predictor = ThroughputPredictor(
        {"r": [(1, 100.0), (2, 200.0)], "i": [(1, 400.0), (2, 800.0)], "rw": [(1, 50.0), (2, 100.0)]}
    )
    actor = node("a", ACTOR, 1, ("i", "rw"))
    predictor.set_profile("a", [(1, 200.0), (2, 400.0)])
    graph = Hypergraph(
        job_id="j",
        nodes=(
            node("r", ROLLOUT, 1),
            node("i", ComponentKind.INFERENCE, 1, ("r",)),
            node("rw", ComponentKind.REWARD, 1, ("r",)),
            actor,
        ),
    )
    # Branches r->i->a and r->rw->a overlap; the reward branch (1/50) is the longer one.
    expected = 1.0 / (1 / 100 + 1 / 50 + 1 / 200)
    assert predictor.predict_job(graph, model=JobModel.SEQUENTIAL) == pytest.approx(expected, rel=1e-6)


def test_cpu_side_groups_do_not_count_towards_the_job():
    predictor = ThroughputPredictor({"rollout": [(1, 300.0), (2, 600.0)]})
    tool = HyperNode(id="tools", kind=ComponentKind.TOOL)
    graph = Hypergraph(job_id="j", nodes=(node("r", ROLLOUT, 2), tool))
    assert predictor.predict_job(graph) == pytest.approx(600.0, rel=1e-6)


def test_error_accounting_and_mape():
    predictor = ThroughputPredictor()
    predictor.record_prediction("k1", "a", predicted=110.0, at=1.0)
    predictor.record_prediction("k2", "a", predicted=90.0, at=2.0)
    predictor.record_prediction("k3", "r", predicted=300.0, at=3.0)
    assert predictor.mape() is None
    predictor.record_observation("k1", 100.0, at=5.0)
    predictor.record_observation("k2", 100.0, at=6.0)
    record = predictor.record_observation("k3", 200.0, at=7.0)
    assert record.abs_error == pytest.approx(100.0)
    assert record.relative_error == pytest.approx(0.5)
    assert [r.key for r in predictor.errors()] == ["k1", "k2", "k3"]
    assert predictor.mape("a") == pytest.approx(10.0)
    assert predictor.mape() == pytest.approx((10 + 10 + 50) / 3)
    assert predictor.mape("nobody") is None
    assert predictor.errors()[0].to_json()["relative_error"] == pytest.approx(0.1)


def test_unknown_or_already_observed_predictions_are_errors():
    predictor = ThroughputPredictor()
    with pytest.raises(KeyError):
        predictor.record_observation("missing", 1.0, at=1.0)
    predictor.record_prediction("k", "a", 10.0, at=1.0)
    predictor.record_prediction("k", "a", 12.0, at=1.5)  # a retried tick replaces its open prediction
    assert [r.predicted for r in predictor.pending()] == [12.0]
    predictor.record_observation("k", 12.0, at=2.0)
    with pytest.raises(ValueError, match="already observed"):
        predictor.record_prediction("k", "a", 10.0, at=3.0)


def test_samples_at_several_sizes_recover_the_exponent_without_a_profile():
    predictor = ThroughputPredictor()
    for t, gpus in enumerate((2, 4, 8, 16) * 5):
        predictor.observe("r", ROLLOUT, gpus, 500.0 * gpus**0.6, at=float(t))
    fit = predictor.fit("r", ROLLOUT)
    assert fit.exponent == pytest.approx(0.6, abs=1e-6)
    assert predictor.predict("r", ROLLOUT, 32) == pytest.approx(500.0 * 32**0.6, rel=1e-6)


def test_samples_at_one_size_shift_the_level_but_keep_the_profiles_shape():
    predictor = ThroughputPredictor({"rollout": power_profile(1000.0, 0.7)})
    for t in range(40):
        predictor.observe("r", ROLLOUT, 8, 2.0 * 1000.0 * 8**0.7, at=float(t))
    fit = predictor.fit("r", ROLLOUT)
    assert fit.exponent == pytest.approx(0.7, abs=1e-6)
    assert predictor.predict("r", ROLLOUT, 2) == pytest.approx(2.0 * 1000.0 * 2**0.7, rel=0.02)
