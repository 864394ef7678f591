"""The aggregated decode engine: step arithmetic, admission, completion, KV pressure, cache."""

from __future__ import annotations

import pytest

from scheduler.core.hypergraph import Device
from scheduler.core.sim.engine import Engine, SimRequest
from scheduler.core.sim.hardware import HARDWARE, MODELS
from scheduler.core.sim.perf import EngineCoeffs, PerfModel


def coeffs(capacity: int = 1_000_000, per_sequence_s: float = 1e-5) -> EngineCoeffs:
    return EngineCoeffs(
        fixed_s=0.001,
        weights_s=0.005,
        per_context_token_s=1e-8,
        per_sequence_s=per_sequence_s,
        prefill_s_per_flop=1e-15,
        prefill_overhead_s=0.002,
        params=7e9,
        layers=28,
        hidden=3584,
        kv_capacity_tokens=capacity,
    )


def engine(capacity: int = 1_000_000, max_running: int = 64, **kwargs: float) -> Engine:
    return Engine(
        "rollout-w1",
        (Device("n0-gpu0", "n0", "H100"),),
        coeffs(capacity, **kwargs),
        max_running=max_running,
        peak_tokens_per_s=1000.0,
        kv_reserve_ratio=0.0,
        now=0.0,
    )


def request(rid: int, context: int = 100, remaining: int = 50, episode: int | None = None) -> SimRequest:
    return SimRequest(
        rid=rid,
        episode=rid if episode is None else episode,
        turn=0,
        context=context,
        remaining=remaining,
        max_new=remaining,
        enqueued_at=0.0,
    )


def step_by_step(e: Engine, n: int) -> float:
    """Sum of single steps, the definition the closed form must match."""
    context = e.context()
    total = 0.0
    for _ in range(n):
        total += e.coeffs.step_s(e.batch, context)
        context += e.batch
    return total


@pytest.mark.parametrize("per_sequence_s", [1e-5, 2e-4])  # memory-bound, then compute-bound first
def test_closed_form_step_time_matches_stepwise_sum(per_sequence_s: float) -> None:
    e = engine(per_sequence_s=per_sequence_s)
    for rid in range(40):
        e.add(request(rid, context=100 + rid, remaining=500), 0.0)
    e.flush(0.0)
    for n in (1, 2, 17, 300):
        assert e.time_for(n) == pytest.approx(step_by_step(e, n), rel=1e-9)
        assert e.steps_for(e.time_for(n)) == n
        assert e.steps_for(e.time_for(n) - 1e-7) == n - 1


def test_requests_finish_in_length_order_at_their_step() -> None:
    e = engine()
    for rid, remaining in ((1, 30), (2, 10), (3, 20)):
        e.add(request(rid, remaining=remaining), 0.0)
    e.flush(0.0)
    finished = []
    while e.running:
        upcoming = e.next_event()
        assert upcoming is not None
        e.advance_to_step(upcoming[1])
        finished.extend((r.rid, r.generated) for r in e.pop_finished())
    assert finished == [(2, 10), (3, 20), (1, 30)]
    assert e.decoded_tokens == 60


def test_prefill_delays_decode_and_a_cache_hit_skips_the_cached_prefix() -> None:
    cold = engine()
    cold.add(request(1, context=4000), 0.0)
    cold.flush(0.0)
    warm = engine()
    warm.cache_episode(1, 3900)
    warm.add(request(1, context=4000), 0.0)
    warm.flush(0.0)
    assert cold.origin > warm.origin > 0.0
    assert warm.prefilled_tokens == 100 and cold.prefilled_tokens == 4000
    assert warm.cache_tokens == 0  # the entry became the running request's KV


def test_kv_overflow_retracts_the_youngest_request_to_the_local_queue() -> None:
    e = engine(capacity=1000)
    e.add(request(1, context=300, remaining=400), 0.0)
    e.flush(0.0)
    e.advance_to_step(100)
    e.add(request(2, context=300, remaining=400), 1.0)
    e.flush(1.0)
    upcoming = e.next_event()
    assert upcoming is not None
    _, step = upcoming
    e.advance_to_step(step)
    assert e.context() > e.capacity
    retracted = e.retract_if_full()
    assert [r.rid for r in retracted] == [2]  # fewer tokens generated than request 1
    assert e.context() <= e.capacity
    assert list(e.local) == retracted
    assert retracted[0].context > 300  # its partial output is kept as context to re-prefill


def test_take_back_keeps_progress_and_separates_finished_requests() -> None:
    e = engine()
    e.add(request(1, remaining=10), 0.0)
    e.add(request(2, remaining=1000), 0.0)
    e.flush(0.0)
    e.advance_to_step(10)
    finished, taken = e.take_back_all(e.origin)
    assert [r.rid for r in finished] == [1]
    assert [r.rid for r in taken] == [2]
    assert taken[0].remaining == 990 and taken[0].context == 110
    assert e.batch == 0 and not e.local


def test_admission_respects_slots_and_the_kv_reserve() -> None:
    e = engine(capacity=10_000, max_running=2)
    e.kv_reserve_ratio = 0.5
    big = request(1, context=1000, remaining=4000)
    assert e.fits(big, 0.0)
    e.add(big, 0.0)
    e.flush(0.0)
    # 1000 context + 0.5 * 4000 reserved for the first; the second would need 6000 + 0.5 * 4000.
    assert not e.fits(request(2, context=6000, remaining=4000), 0.0)
    assert e.fits(request(3, context=100, remaining=100), 0.0)
    e.add(request(3, context=100, remaining=100), 0.0)
    assert not e.fits(request(4, context=10, remaining=10), 0.0)  # no slot left


def test_engine_coefficients_follow_the_hardware() -> None:
    perf = PerfModel(MODELS["7B"])
    h100 = perf.engine_coeffs(HARDWARE["H100"])
    h20 = perf.engine_coeffs(HARDWARE["H20"])
    # Decode is memory-bound: the H20's faster HBM wins it; prefill is compute-bound: the H100 wins.
    assert h20.weights_s < h100.weights_s
    assert h20.prefill_s(1e15) > h100.prefill_s(1e15)
    colocated = perf.engine_coeffs(HARDWARE["H100"], colocated=True)
    assert colocated.kv_capacity_tokens < h100.kv_capacity_tokens
    # Throughput grows with the batch (memory-bound), per-step time too.
    assert 64 / h100.step_s(64, 64 * 2000) > 8 / h100.step_s(8, 8 * 2000)
