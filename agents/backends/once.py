"""Running a migration step once however many callers ask for it.

Every node a step names is sent the step, and a retried dispatch sends it again; the work must
happen once. ``OncePerKey`` runs the first caller's call for a key, makes callers that arrive while
it runs wait for its outcome, and hands later callers the kept outcome (a result, or a failure of
the types the caller names) instead of running it again.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any

OUTCOMES_KEPT = 1000


class OncePerKey:
    """Outcomes of calls by key; the ``kept`` latest are kept for callers that ask again."""

    def __init__(self, kept: int = OUTCOMES_KEPT) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._outcomes: OrderedDict[Hashable, dict[str, Any] | Exception] = OrderedDict()
        self._running: dict[Hashable, threading.Event] = {}

    def run(
        self,
        key: Hashable,
        call: Callable[[], Mapping[str, Any]],
        *,
        failures: tuple[type[Exception], ...],
    ) -> dict[str, Any]:
        """``call``'s result for ``key``, run at most once while its outcome is kept. A failure of
        one of ``failures`` is kept and raised to every caller; any other exception is raised to
        this caller only, and the next caller runs the call afresh."""
        while True:
            with self._lock:
                if key in self._outcomes:
                    return self._settled(self._outcomes[key])
                running = self._running.get(key)
                if running is None:
                    done = self._running[key] = threading.Event()
                    break
            running.wait()
        outcome: dict[str, Any] | Exception
        try:
            outcome = dict(call())
        except failures as exc:
            outcome = exc
        except BaseException:
            self._finish(key, done, None)
            raise
        self._finish(key, done, outcome)
        return self._settled(outcome)

    def _finish(
        self, key: Hashable, done: threading.Event, outcome: dict[str, Any] | Exception | None
    ) -> None:
        """Keeps ``outcome`` (None: nothing to keep) and wakes the callers waiting for it."""
        with self._lock:
            del self._running[key]
            if outcome is not None:
                self._outcomes[key] = outcome
                while len(self._outcomes) > self._kept:
                    self._outcomes.popitem(last=False)
        done.set()

    @staticmethod
    def _settled(outcome: dict[str, Any] | Exception) -> dict[str, Any]:
        if isinstance(outcome, Exception):
            raise copy.copy(outcome)  # each caller its own traceback
        return dict(outcome)
