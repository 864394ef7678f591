"""A migration step every node of it is sent runs once: callers that ask while it runs wait for its
outcome, later ones get the kept outcome, and an unexpected error is not kept."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from agents.backends.base import StepFailed
from agents.backends.once import OncePerKey


def test_concurrent_callers_of_one_key_share_one_run_and_its_result() -> None:
    once = OncePerKey()
    runs: list[str] = []
    started, release = threading.Event(), threading.Event()

    def call() -> dict[str, object]:
        runs.append("run")
        started.set()
        release.wait(5)
        return {"ok": True}

    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(once.run, ("step", 1), call, failures=(StepFailed,))
        assert started.wait(5)
        others = [pool.submit(once.run, ("step", 1), call, failures=(StepFailed,)) for _ in range(3)]
        release.set()
        results = [first.result(5), *(f.result(5) for f in others)]
    assert runs == ["run"] and results == [{"ok": True}] * 4
    # A retried attempt is another key: it runs.
    assert once.run(("step", 2), call, failures=(StepFailed,)) == {"ok": True} and len(runs) == 2


def test_a_named_failure_is_kept_and_raised_to_every_caller() -> None:
    once = OncePerKey()
    calls = 0

    def call() -> dict[str, object]:
        nonlocal calls
        calls += 1
        raise StepFailed("node-a: start_workers: no device")

    for _ in range(2):
        with pytest.raises(StepFailed, match="no device"):
            once.run("k", call, failures=(StepFailed,))
    assert calls == 1


def test_an_unexpected_error_is_not_kept_and_the_next_caller_runs_afresh() -> None:
    once = OncePerKey()
    outcomes = iter([KeyError("lost"), None])

    def call() -> dict[str, object]:
        error = next(outcomes)
        if error is not None:
            raise error
        return {"ok": True}

    with pytest.raises(KeyError):
        once.run("k", call, failures=(StepFailed,))
    assert once.run("k", call, failures=(StepFailed,)) == {"ok": True}


def test_only_the_latest_outcomes_are_kept() -> None:
    once = OncePerKey(kept=2)
    runs: list[int] = []
    for key in (1, 2, 3, 1):
        once.run(key, lambda key=key: runs.append(key) or {"key": key}, failures=())
    assert runs == [1, 2, 3, 1]  # key 1 had been dropped when it came back
