"""An episode as the simulators run it: one sample's trace record and how far its turns have got.

The offline simulator (``simulator.py``) and the ``sim`` backend's host
(``agents/backends/sim/host.py``) both drive episodes through the same turns: each turn is one
engine request for the turn's response tokens after the context so far; between turns a tool call
adds its output to the context. Each side extends ``Episode`` with its own bookkeeping (the
iteration it belongs to, or the worker running it).
"""

from __future__ import annotations

from scheduler.core.sim.engine import SimRequest
from scheduler.core.sim.trace import TraceRecord


class Episode:
    """One sample's progress through its turns."""

    __slots__ = ("context", "record", "turn")

    def __init__(self, record: TraceRecord) -> None:
        self.record = record
        self.turn = 0
        self.context = record.prompt_tokens  # tokens before this turn's response

    @property
    def response_tokens(self) -> int:
        """What the current turn generates."""
        return self.record.response_tokens[self.turn]

    @property
    def fresh_tokens(self) -> int:
        """Tokens of the current turn's context no engine has seen yet: the prompt, or the output of
        the tool call before the turn."""
        return self.record.prompt_tokens if self.turn == 0 else self.record.tool_output_tokens[self.turn - 1]

    @property
    def tool_latency_s(self) -> float:
        """The tool call after the current turn."""
        return self.record.tool_latency_s[self.turn]

    @property
    def has_next_turn(self) -> bool:
        return self.turn + 1 < self.record.turns

    def tool_done(self) -> int:
        """The tool call after the current turn returned: its output joins the context and the next
        turn begins. Returns the output's tokens."""
        output = self.record.tool_output_tokens[self.turn]
        self.context += output
        self.turn += 1
        return output

    def request(
        self,
        rid: int,
        cache_key: int,
        now: float,
        *,
        max_new: int,
        remaining: int | None = None,
        fresh: int | None = None,
    ) -> SimRequest:
        """The engine request for the current turn. ``cache_key`` names the episode in the engines'
        radix caches; ``remaining`` (default: the turn's response) and ``fresh`` (default:
        ``fresh_tokens``) are given for a turn resumed elsewhere."""
        request = SimRequest(
            rid=rid,
            episode=cache_key,
            turn=self.turn,
            context=self.context,
            remaining=self.response_tokens if remaining is None else remaining,
            max_new=max_new,
            enqueued_at=now,
            completed_tool_calls=self.turn,
        )
        request.fresh = self.fresh_tokens if fresh is None else fresh
        return request
