import random

import pytest

from runtime.rl.router import TURN_LENGTH_MIN_SAMPLES, DataRouter, RoutedRequest, RouterMode


def _req(
    request_id: str,
    *,
    episode: str | None = None,
    tools: int = 0,
    prefix: int = 0,
    at: float = 0.0,
) -> RoutedRequest:
    return RoutedRequest(
        request_id=request_id,
        episode_id=episode or f"ep-{request_id}",
        completed_tool_calls=tools,
        prefix_tokens=prefix,
        enqueued_at=at,
    )


def _drain(router: DataRouter, worker: str, now: float) -> list[str]:
    out = []
    while (request := router.next_for_worker(worker, now)) is not None:
        out.append(request.request_id)
    return out


def _router(**kw: object) -> DataRouter:
    router = DataRouter(**kw)  # type: ignore[arg-type]
    router.set_workers(["w0", "w1"])
    return router


def test_priority_ordering() -> None:
    router = _router()
    router.submit(_req("new-episode", tools=0, prefix=100, at=0.0))
    router.submit(_req("two-tools-short", tools=2, prefix=10, at=3.0))
    router.submit(_req("two-tools-long", tools=2, prefix=500, at=4.0))
    router.submit(_req("one-tool", tools=1, prefix=9000, at=1.0))
    router.submit(_req("two-tools-long-older", tools=2, prefix=500, at=2.0))
    assert _drain(router, "w0", 5.0) == [
        "two-tools-long-older",
        "two-tools-long",
        "two-tools-short",
        "one-tool",
        "new-episode",
    ]
    assert len(router) == 0


def test_fifo_mode_orders_by_age() -> None:
    router = _router(mode=RouterMode.FIFO)
    router.submit(_req("b", tools=5, prefix=900, at=2.0))
    router.submit(_req("a", tools=0, prefix=1, at=1.0))
    router.submit(_req("c", tools=1, at=3.0))
    assert _drain(router, "w0", 5.0) == ["a", "b", "c"]
    assert router.stats.mode_now is RouterMode.FIFO


def test_affinity_hit_keeps_episode_on_its_worker() -> None:
    router = _router()
    router.note_affinity("ep", "w1")
    router.submit(_req("turn2", episode="ep", tools=3, prefix=2000, at=1.0))
    router.submit(_req("other", tools=0, at=1.0))
    # w0 may not take the follow-up turn while w1 holds its cache and it is fresh.
    assert router.next_for_worker("w0", 1.5).request_id == "other"  # type: ignore[union-attr]
    assert router.next_for_worker("w0", 1.5) is None
    assert router.next_for_worker("w1", 1.5).request_id == "turn2"  # type: ignore[union-attr]
    assert router.stats.affinity_hits == 1
    assert router.stats.affinity_fallbacks == 0


def test_dispatch_records_affinity_for_the_next_turn() -> None:
    router = _router()
    router.submit(_req("turn1", episode="ep", at=0.0))
    assert router.next_for_worker("w1", 0.0) is not None
    router.submit(_req("turn2", episode="ep", tools=1, at=1.0))
    assert router.next_for_worker("w0", 1.0) is None
    assert router.next_for_worker("w1", 1.0).request_id == "turn2"  # type: ignore[union-attr]
    assert router.stats.affinity_hits == 1


def test_own_affine_request_competes_with_shared_by_priority() -> None:
    router = _router()
    router.note_affinity("ep", "w0")
    router.submit(_req("mine-low", episode="ep", tools=1, at=1.0))
    router.submit(_req("shared-high", tools=4, at=1.0))
    assert _drain(router, "w0", 1.0) == ["shared-high", "mine-low"]


def test_fallback_when_affinity_worker_is_gone() -> None:
    router = _router()
    router.note_affinity("ep-queued", "w1")
    router.note_affinity("ep-later", "w1")
    router.submit(_req("queued", episode="ep-queued", tools=1, at=1.0))
    router.set_workers(["w0"])  # w1 migrated away
    assert router.next_for_worker("w1", 1.0) is None  # a removed worker gets nothing
    assert router.next_for_worker("w0", 1.0).request_id == "queued"  # type: ignore[union-attr]
    router.submit(_req("later", episode="ep-later", tools=1, at=2.0))
    assert router.next_for_worker("w0", 2.0).request_id == "later"  # type: ignore[union-attr]
    stats = router.stats
    assert stats.affinity_fallbacks == 2
    assert stats.affinity_hits == 0
    # A first turn with no cache anywhere is neither a hit nor a fallback.
    router.submit(_req("fresh", at=3.0))
    router.next_for_worker("w0", 3.0)
    assert router.stats.affinity_fallbacks == 2


def test_steal_only_after_affinity_wait() -> None:
    router = _router(affinity_wait_s=2.0)
    router.note_affinity("ep", "w1")
    router.submit(_req("turn", episode="ep", tools=2, at=10.0))
    assert router.next_for_worker("w0", 11.9) is None  # w1 is busy but the wait is short
    assert router.next_for_worker("w0", 12.1).request_id == "turn"  # type: ignore[union-attr]
    assert router.stats.affinity_steals == 1
    assert router.stats.affinity_hits == 0
    # The cache now lives on w0: the episode's next turn follows it.
    router.submit(_req("turn-next", episode="ep", tools=3, at=13.0))
    assert router.next_for_worker("w1", 13.0) is None
    assert router.next_for_worker("w0", 13.0) is not None


def test_a_worker_out_of_balance_gives_follow_up_turns_to_an_idle_one() -> None:
    # w2 joined after the episodes were dispatched: every later turn asks for w0 or w1, which
    # admit it at once, so without the loads w2 would never get work.
    router = DataRouter(balance_abs_threshold=32)
    router.set_workers(["w0", "w1", "w2"])
    for k in range(3):
        router.note_affinity(f"ep{k}", "w0")
    router.note_affinity("ep-w1", "w1")
    for k in range(3):
        router.submit(_req(f"turn{k}", episode=f"ep{k}", tools=1, at=1.0))
    router.submit(_req("turn-w1", episode="ep-w1", tools=1, at=1.0))
    loads = {"w0": 100, "w1": 60, "w2": 0}
    assert router.next_for_worker("w2", 1.0) is None  # no loads given: affinity holds
    # The most loaded worker with turns waiting gives first, best turn first.
    taken = router.next_for_worker("w2", 1.0, loads)
    assert taken is not None and taken.episode_id in {"ep0", "ep1", "ep2"}
    assert router.stats.affinity_steals == 1
    # The cache now lives on w2: that episode's next turn follows it.
    router.submit(_req("next", episode=taken.episode_id, tools=2, at=2.0))
    assert router.next_for_worker("w0", 2.0, {"w0": 100, "w1": 60, "w2": 1}).request_id != "next"  # type: ignore[union-attr]
    assert router.next_for_worker("w2", 2.0, {"w0": 99, "w1": 60, "w2": 1}).request_id == "next"  # type: ignore[union-attr]
    # Within the absolute threshold the group is in balance: turns wait for their own worker.
    assert router.next_for_worker("w2", 2.0, {"w0": 40, "w1": 40, "w2": 9}) is None
    # Out of balance with w1 only (w0 has no turns waiting): w2 takes w1's.
    router.next_for_worker("w0", 2.0)
    assert router.next_for_worker("w2", 2.0, {"w0": 0, "w1": 60, "w2": 2}).request_id == "turn-w1"  # type: ignore[union-attr]
    assert router.stats.affinity_steals == 2


def test_balance_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        DataRouter(balance_abs_threshold=-1)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        DataRouter(balance_rel_threshold=0.5)


def test_starvation_bound_jumps_ahead() -> None:
    router = _router(max_wait_s=30.0)
    router.submit(_req("starved", tools=0, prefix=0, at=0.0))
    router.submit(_req("older-starved", tools=0, prefix=0, at=-5.0))
    for k in range(5):
        router.submit(_req(f"hot{k}", tools=5, at=20.0 + k))
    # At t=25 nobody waited 30 s: priority order.
    assert router.next_for_worker("w0", 25.0).request_id == "hot0"  # type: ignore[union-attr]
    # At t=31 both old requests waited over 30 s: they go first, oldest first.
    assert _drain(router, "w0", 31.0)[:2] == ["older-starved", "starved"]
    assert router.stats.starvation_promotions == 2


def test_starvation_bound_overrides_affinity() -> None:
    router = _router(max_wait_s=5.0, affinity_wait_s=60.0)
    router.note_affinity("ep", "w1")
    router.submit(_req("stuck", episode="ep", at=0.0))
    assert router.next_for_worker("w0", 4.0) is None
    assert router.next_for_worker("w0", 6.0).request_id == "stuck"  # type: ignore[union-attr]


def _feed_turns(router: DataRouter, lengths_by_turn: dict[int, int]) -> None:
    for _ in range(TURN_LENGTH_MIN_SAMPLES):
        for turn, length in lengths_by_turn.items():
            router.note_turn_length(turn, length)


def test_auto_fifo_when_later_turns_are_not_shorter() -> None:
    router = _router()
    router.submit(_req("old-fresh", tools=0, at=1.0))
    router.submit(_req("young-deep", tools=3, at=2.0))
    assert router.stats.mode_now is RouterMode.PRIORITY
    _feed_turns(router, {0: 100, 1: 200, 2: 400})  # later turns are longer
    assert router.stats.mode_now is RouterMode.FIFO
    assert _drain(router, "w0", 3.0) == ["old-fresh", "young-deep"]
    # Once later turns get shorter again, priority comes back.
    _feed_turns(router, {0: 2000, 1: 100, 2: 50})
    _feed_turns(router, {0: 2000, 1: 100, 2: 50})
    assert router.stats.mode_now is RouterMode.PRIORITY
    router.submit(_req("old-fresh2", tools=0, at=4.0))
    router.submit(_req("young-deep2", tools=3, at=5.0))
    assert _drain(router, "w0", 6.0) == ["young-deep2", "old-fresh2"]


def test_equal_turn_lengths_count_as_not_shorter() -> None:
    router = _router()
    _feed_turns(router, {0: 300, 1: 300})
    assert router.stats.mode_now is RouterMode.FIFO


def test_auto_fifo_can_be_switched_off_and_needs_evidence() -> None:
    router = _router(auto_fifo=False)
    _feed_turns(router, {0: 100, 1: 400})
    assert router.stats.mode_now is RouterMode.PRIORITY
    router = _router()
    for _ in range(TURN_LENGTH_MIN_SAMPLES - 1):
        router.note_turn_length(0, 100)
        router.note_turn_length(1, 400)
    assert router.stats.mode_now is RouterMode.PRIORITY  # too few samples to decide


def test_mode_switch_keeps_affinity_queues_correct() -> None:
    router = _router()
    router.note_affinity("ep", "w1")
    router.submit(_req("affine", episode="ep", tools=1, at=0.0))
    router.submit(_req("free", tools=0, at=0.5))
    _feed_turns(router, {0: 100, 1: 400})
    assert router.stats.mode_now is RouterMode.FIFO
    assert _drain(router, "w0", 1.0) == ["free"]
    assert _drain(router, "w1", 1.0) == ["affine"]


def test_take_back_requeues_with_original_age_and_drops_affinity() -> None:
    router = _router(max_wait_s=30.0)
    router.submit(_req("r1", episode="ep", at=0.0))
    taken = router.next_for_worker("w1", 0.0)
    assert taken is not None
    # w1 is paused by a migration; its in-flight request comes back with its partial output.
    resumed = RoutedRequest(
        "r1", "ep", 0, prefix_tokens=350, enqueued_at=taken.enqueued_at, payload="partial"
    )
    router.take_back([resumed])
    router.submit(_req("newer", tools=0, at=10.0))
    # No longer tied to w1, and its age is kept: it is older than "newer".
    got = router.next_for_worker("w0", 10.0)
    assert got is not None and got.request_id == "r1" and got.payload == "partial"
    assert router.stats.affinity_fallbacks == 1
    # Age is kept: past max_wait_s it is promoted.
    router.take_back([resumed])
    router.submit(_req("hot", tools=9, at=31.0))
    assert router.next_for_worker("w0", 31.0).request_id == "r1"  # type: ignore[union-attr]


def test_submit_is_idempotent_and_take_back_replaces() -> None:
    router = _router()
    router.submit(_req("r", prefix=1, at=0.0))
    router.submit(_req("r", prefix=999, at=0.0))
    assert len(router) == 1
    router.take_back([_req("r", prefix=500, at=0.0)])
    assert len(router) == 1
    got = router.next_for_worker("w0", 0.0)
    assert got is not None and got.prefix_tokens == 500
    assert len(router) == 0


def test_without_affinity_is_plain_ordering() -> None:
    router = _router(use_affinity=False)
    router.note_affinity("ep", "w1")
    router.submit(_req("turn", episode="ep", tools=1, at=0.0))
    assert router.next_for_worker("w0", 0.0) is not None
    assert router.stats.affinity_hits == router.stats.affinity_fallbacks == router.stats.affinity_steals == 0


def test_unknown_worker_gets_nothing() -> None:
    router = _router()
    router.submit(_req("r"))
    assert router.next_for_worker("stranger", 0.0) is None
    assert len(router) == 1


def test_stats_count_dispatches() -> None:
    router = _router()
    for k in range(5):
        router.submit(_req(f"r{k}", at=float(k)))
    _drain(router, "w0", 5.0)
    stats = router.stats
    assert stats.dispatched == 5
    assert stats.queued == 0


def _reference_pick(queued: list[RoutedRequest]) -> RoutedRequest:
    return min(queued, key=lambda r: (-r.completed_tool_calls, -r.prefix_tokens, r.enqueued_at))


def test_many_requests_match_a_reference_order() -> None:
    rng = random.Random(7)
    router = _router(max_wait_s=1e9)
    queued: list[RoutedRequest] = []
    now = 0.0
    for k in range(3000):
        now += 0.01
        request = _req(f"r{k}", tools=rng.randint(0, 4), prefix=rng.randint(0, 5000), at=now)
        router.submit(request)
        queued.append(request)
        if rng.random() < 0.4:
            got = router.next_for_worker(rng.choice(["w0", "w1"]), now)
            # Every request is a first turn of its own episode: no affinity, pure priority order.
            expected = _reference_pick(queued)
            assert got == expected
            queued.remove(expected)
    assert len(router) == len(queued)


def test_lazy_deletion_does_not_grow_without_bound() -> None:
    router = _router(affinity_wait_s=0.0)
    for k in range(20000):
        router.note_affinity(f"ep{k}", "w1")  # w1 never asks: its queue only fills
        router.submit(_req(f"r{k}", episode=f"ep{k}", at=float(k)))
        router.next_for_worker("w0", float(k) + 1.0)
    assert len(router) == 0
    items = len(router._shared) + len(router._by_age) + len(router._affine_by_age)
    items += sum(len(q) for q in router._worker_queues.values())
    assert items < 20000


@pytest.mark.parametrize("kwargs", [{"max_wait_s": -1.0}, {"affinity_wait_s": -0.5}])
def test_constructor_refuses_negative_waits(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DataRouter(**kwargs)  # type: ignore[arg-type]


def test_auto_fifo_does_not_flap_on_a_flat_profile() -> None:
    router = _router()
    _feed_turns(router, {0: 300, 1: 300})
    assert router.stats.mode_now is RouterMode.FIFO
    # Barely shorter later turns (under the margin) keep FIFO; clearly shorter ones restore priority.
    _feed_turns(router, {0: 300, 1: 298})
    assert router.stats.mode_now is RouterMode.FIFO
    for _ in range(5):
        _feed_turns(router, {0: 300, 1: 200})
    assert router.stats.mode_now is RouterMode.PRIORITY


def test_switching_mode_at_runtime_reorders_the_queue() -> None:
    router = _router()
    router.submit(_req("old-fresh", tools=0, at=1.0))
    router.submit(_req("young-deep", tools=3, at=2.0))
    router.mode = RouterMode.FIFO
    assert router.next_for_worker("w0", 3.0).request_id == "old-fresh"  # type: ignore[union-attr]
    router.submit(_req("old-fresh2", tools=0, at=1.5))
    _feed_turns(router, {0: 100, 1: 400})  # the detector says FIFO
    router.mode = RouterMode.PRIORITY
    assert router.stats.mode_now is RouterMode.FIFO
    router.auto_fifo = False
    assert router.stats.mode_now is RouterMode.PRIORITY
    assert _drain(router, "w0", 3.0) == ["young-deep", "old-fresh2"]
