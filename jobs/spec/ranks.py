"""GPU rank lists: ``"0-3"``, ``"0-1,4-5"``, ``"all"`` expanded (every bound checked before a range
is expanded) and sets of ranks written back compactly."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from jobs.spec.errors import RankError
from jobs.spec.values import describe, is_int, shown

# The most GPU (or node) ranks one rank list may name, and GPUs an RLinf cluster may span; checked
# before a range is expanded, so "0-9999999" costs nothing.
MAX_GPU_RANKS: Final = 65_536


def parse_gpu_ranks(value: object, limit: int | None, *, capacity: str | None = None) -> tuple[int, ...]:
    """Expand ``"0-3"``, ``"0-1,4-5"``, ``"0-3,6"``, ``"all"`` or a single integer into sorted ranks.

    ``limit`` is how many ranks exist (``None``: unknown, then ``"all"`` cannot be expanded and
    ranks are only checked against ``MAX_GPU_RANKS``); ``capacity`` describes them in messages
    (default "the cluster's N GPUs"). Every bound is checked before a range is expanded. Raises
    ``RankError``.
    """
    within = capacity if capacity is not None else f"the cluster's {limit} GPUs"
    if is_int(value):
        assert isinstance(value, int)
        if value >= MAX_GPU_RANKS:  # also keeps str() away from integers of thousands of digits
            raise RankError(f"rank {shown(value)} is above {MAX_GPU_RANKS - 1}, the highest a spec may name")
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise RankError(f'must be a rank list such as "0-3", "0-1,4-5" or "all", got {describe(value)}')
    if text == "all":
        if limit is None:
            raise RankError('"all" needs the cluster size; list the ranks or validate against a cluster')
        if limit > MAX_GPU_RANKS:
            raise RankError(f'"all" would name {limit} ranks; a rank list may name at most {MAX_GPU_RANKS}')
        return tuple(range(limit))
    if not text:
        raise RankError('is empty; give ranks such as "0-3" or "all"')
    ranks: list[int] = []
    seen: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if match is None:
            raise RankError(f"{shown(part)} is not a rank or a range a-b (in {shown(text)})")
        digits = max(len(match.group(1)), len(match.group(2) or ""))
        if digits > len(str(MAX_GPU_RANKS)):
            raise RankError(
                f"{shown(part)} names a rank above {MAX_GPU_RANKS - 1}, the highest a spec may name"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        label = f"range {first}-{last}" if match.group(2) is not None else f"rank {first}"
        if last < first:
            raise RankError(f"{label} is reversed (write {last}-{first})")
        if limit is not None and last >= limit:
            raise RankError(f"{label} exceeds {within} (ranks 0-{limit - 1})")
        if last >= MAX_GPU_RANKS:
            raise RankError(f"{label} goes above rank {MAX_GPU_RANKS - 1}, the highest a spec may name")
        for rank in range(first, last + 1):
            if rank in seen:
                raise RankError(f"rank {rank} is listed twice in {shown(text)}")
            seen.add(rank)
            ranks.append(rank)
    return tuple(sorted(ranks))


def format_gpu_ranks(ranks: Iterable[int], *, max_spans: int = 16) -> str:
    """The compact form of a rank set: ``[0, 1, 2, 3, 6]`` -> ``"0-3,6"``; past ``max_spans``
    spans the rest is counted (``"0,2,4,...(+99 more)"``), since messages quote it."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    index = 0
    while index < len(ordered):
        if len(spans) == max_spans:
            return ",".join(spans) + f",...(+{len(ordered) - index} more ranks)"
        start = index
        while index + 1 < len(ordered) and ordered[index + 1] == ordered[index] + 1:
            index += 1
        first, last = ordered[start], ordered[index]
        spans.append(str(first) if first == last else f"{first}-{last}")
        index += 1
    return ",".join(spans)
