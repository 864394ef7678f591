"""Aborts by rid prefix, the three pause modes, flush_cache: all through the client."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from runtime.engine.client import GenerateResult, make_rid
from tests.runtime.engine.conftest import WAIT_S, Served, greedy_reference, make_model

PROMPT = [2, 7, 1, 8, 2, 8]
LONG = {"max_new_tokens": 200, "temperature": 0.0}
# Slow decode steps so that requests are still in flight when the test acts on them.
STEP_SLEEP_S = 0.01


def start_slow(serve: Callable[..., Served], **settings: object) -> Served:
    served = serve(**settings)
    served.client.slow_down(STEP_SLEEP_S)
    return served


def assert_partial(result: GenerateResult, at_least: int) -> None:
    assert result.aborted, result.finish_reason
    assert at_least <= len(result.output_ids) < LONG["max_new_tokens"]
    assert len(result.output_logprobs) == len(result.output_ids) == result.completion_tokens


def test_abort_matches_rids_by_prefix_and_returns_partial_output(serve: Callable[..., Served]) -> None:
    served = start_slow(serve)
    with ThreadPoolExecutor(3) as pool:
        futures = {
            rid: pool.submit(served.client.generate, PROMPT, LONG, rid, True)
            for rid in ("grp-1", "grp-10", "other")
        }
        for rid in futures:
            served.wait_tokens(rid, 3)
        served.client.abort_request("grp")  # names no request in flight: SGLang does nothing
        served.client.abort_request("grp-1")  # in flight, and a prefix of grp-10: both go
        first, tenth = futures["grp-1"].result(WAIT_S), futures["grp-10"].result(WAIT_S)
        assert_partial(first, 3)
        assert_partial(tenth, 3)
        assert first.output_ids == greedy_reference(make_model(0), PROMPT, len(first.output_ids))[0]
        assert not futures["other"].done()
        served.client.abort_request(abort_all=True)
        assert_partial(futures["other"].result(WAIT_S), 3)
    assert served.engine.state()["aborted_requests"] == 3


def test_make_rid_never_builds_a_prefix_of_another_rid() -> None:
    rids = [
        make_rid(job, iteration, sample)
        for job in ("j", "j1")
        for iteration in (1, 10)
        for sample in (1, 10, 100)
    ]
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]


def test_pause_abort_returns_partial_output_and_holds_new_requests_until_continue(
    serve: Callable[..., Served],
) -> None:
    served = start_slow(serve)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(served.client.generate, PROMPT, LONG, "running.", True)
        served.wait_tokens("running.", 2)
        served.client.pause_generation("abort")
        assert_partial(running.result(WAIT_S), 2)
        held = pool.submit(served.client.generate, PROMPT, {"max_new_tokens": 5, "temperature": 0.0}, "held.")
        served.wait(lambda: served.engine.state()["num_waiting_reqs"] == 1, "the new request to queue")
        assert served.engine.generated_tokens("held.") == 0
        served.client.continue_generation()
        assert held.result(WAIT_S).output_ids == greedy_reference(make_model(0), PROMPT, 5)[0]


@pytest.mark.parametrize("flush_while_retracted", [False, True])
def test_pause_retract_requeues_with_partial_state_and_resumes(
    serve: Callable[..., Served], flush_while_retracted: bool
) -> None:
    served = start_slow(serve)
    params = {"max_new_tokens": 40, "temperature": 0.0}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(served.client.generate, PROMPT, params, "retracted.", True)
        served.wait_tokens("retracted.", 10)
        served.client.pause_generation("retract")
        state = served.engine.state()
        assert (state["num_running_reqs"], state["num_waiting_reqs"], state["num_retracted_reqs"]) == (
            0,
            1,
            1,
        )
        kept = served.engine.generated_tokens("retracted.")
        assert kept >= 10
        if flush_while_retracted:
            assert served.client.flush_cache() is True  # SGLang allows it in retract mode
        served.client.continue_generation()
        result = future.result(WAIT_S)
    assert result.output_ids == greedy_reference(make_model(0), PROMPT, 40)[0]
    assert result.meta_info["retraction_count"] == 1
    if flush_while_retracted:
        assert result.cached_tokens == 0  # everything recomputed
    else:
        # The retracted KV went to the prefix cache and the re-admission read it back.
        assert result.cached_tokens >= (len(PROMPT) + kept - 1) // 4 * 4 > 0


def test_pause_in_place_keeps_everything_and_flush_is_refused_meanwhile(serve: Callable[..., Served]) -> None:
    served = start_slow(serve)
    params = {"max_new_tokens": 30, "temperature": 0.0}
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(served.client.generate, PROMPT, params, "in-place.", True)
        served.wait_tokens("in-place.", 5)
        served.client.pause_generation("in_place")
        frozen = served.engine.generated_tokens("in-place.")
        # A bounded wait for something that must not happen: no step while paused in place.
        assert not served.engine.wait_until(lambda: served.engine.generated_tokens("in-place.") > frozen, 0.3)
        assert served.engine.state()["num_running_reqs"] == 1
        assert served.client.flush_cache() is False
        served.client.continue_generation()
        result = future.result(WAIT_S)
    assert result.output_ids == greedy_reference(make_model(0), PROMPT, 30)[0]
    assert result.meta_info["retraction_count"] == 0


def test_flush_cache_drops_cached_prefixes(serve: Callable[..., Served]) -> None:
    served = serve()
    params = {"max_new_tokens": 3, "temperature": 0.0}
    served.client.generate([*PROMPT, 5, 5, 1], params)
    assert served.client.generate([*PROMPT, 5, 5, 2], params).cached_tokens == 8
    assert served.engine.state()["prefix_cache_tokens"] > 0
    assert served.client.flush_cache() is True
    assert served.engine.state()["prefix_cache_tokens"] == 0
    assert served.client.generate([*PROMPT, 5, 5, 3], params).cached_tokens == 0
