"""Guarded state transitions for rows that carry background work.

Each model with a ``state`` field declares its allowed transitions; ``advance`` refuses anything
else, so a terminal state can never be left and no code path can skip a step.
"""

from __future__ import annotations

from collections.abc import Mapping


class IllegalTransition(Exception):
    def __init__(self, model: str, current: str, target: str) -> None:
        super().__init__(f"{model} cannot go from {current!r} to {target!r}")
        self.current = current
        self.target = target


def check_transition(model: str, allowed: Mapping[str, frozenset[str]], current: str, target: str) -> None:
    if target not in allowed.get(current, frozenset()):
        raise IllegalTransition(model, current, target)


def terminal_states(allowed: Mapping[str, frozenset[str]]) -> frozenset[str]:
    return frozenset(state for state, targets in allowed.items() if not targets)
