"""The agentic task's tool: a calculator the model calls mid-answer (see `arithmetic` for the
transcript format).

It evaluates integer expressions of ``+``, ``-`` and ``*`` with the usual precedence, and nothing
else: no Python ``eval``, no parentheses, bounded length. ``latency_s`` stands for the round trip
to a real tool service (a search API, a sandbox): the call sleeps that long, so the rollout has
to keep its engines busy with other episodes meanwhile.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

# Longer expressions are refused: a policy that rambles must not make the tool slow or the
# answer longer than the context.
MAX_EXPRESSION_CHARS = 64
_TOKEN = re.compile(r"\d+|[+\-*]")


class ToolCallError(ValueError):
    """The model's expression is not one the calculator evaluates."""


def evaluate(expression: str) -> int:
    """The value of ``expression``: unsigned integers joined by ``+``, ``-`` and ``*``."""
    if not expression:
        raise ToolCallError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolCallError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = _TOKEN.findall(expression)
    if "".join(tokens) != expression:
        raise ToolCallError(f"{expression!r} holds characters other than digits, +, - and *")
    if len(tokens) % 2 == 0 or not all(token.isdigit() for token in tokens[::2]):
        raise ToolCallError(f"{expression!r} is not numbers joined by operators")
    # Products first, then a left-to-right sum of signed products.
    total = 0
    sign = 1
    product = int(tokens[0])
    for operator, operand in zip(tokens[1::2], tokens[2::2], strict=True):
        if operator == "*":
            product *= int(operand)
            continue
        total += sign * product
        sign = 1 if operator == "+" else -1
        product = int(operand)
    return total + sign * product


@dataclass(frozen=True)
class Calculator:
    """The tool as a worker hosts it; ``call`` returns the text appended to the episode."""

    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must not be negative, got {self.latency_s}")

    def call(self, expression: str) -> str:
        value = evaluate(expression)
        if self.latency_s:
            time.sleep(self.latency_s)
        return f"{value}\n"
