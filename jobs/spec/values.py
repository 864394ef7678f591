"""How values given by the user are classified and quoted in messages: type checks that refuse
booleans as numbers, and descriptions, excerpts and suggestions whose length never grows with the
document."""

from __future__ import annotations

import difflib
import math
import reprlib
from collections.abc import Collection, Mapping
from typing import Final

# Values echoed in messages are cut to a few dozen characters: a message must never grow with the
# document (repr() of a structure an alias chain repeats a billion times never ends).
_SHORT: Final = reprlib.Repr()
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlong = 40
_SHORT.maxlevel = 2
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


def shown(value: object) -> str:
    """repr() of a value given by the user, bounded in length."""
    return _SHORT.repr(value)


def is_int(value: object) -> bool:
    # bool is an int subclass; ``true`` where a count belongs is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    if is_int(value):
        return True
    return isinstance(value, float) and math.isfinite(value)


def describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, int):
        return f"an integer ({shown(value)})"
    if isinstance(value, float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        excerpt = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({excerpt!r})"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, for messages that quote something of unknown length."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def suggestion(key: str, allowed: Collection[str]) -> str:
    if len(key) > 100:  # no known name is that long; difflib's cost grows with the length
        return ""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
