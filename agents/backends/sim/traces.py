"""Which trace files a job may make the agent read.

A job spec's ``workload.trace`` names a JSONL trace (docs/trace-format.md). The agent opens it as
the user it runs as, root on many GPU hosts, so it reads only files under the directory it was
configured to read (``--trace-dir``, none by default). The control plane refuses what it can tell
from the text alone (absolute paths, ``..``, NUL bytes); here the path is resolved as the file
system sees it, symbolic links included, and refused if it leads outside that directory. The refusal
reads the same whether or not the file exists, so it tells the submitter nothing about files outside.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


class TraceRefused(ValueError):
    """A trace path this agent will not open; the message never says whether the file exists."""


def _shown(name: str) -> str:
    return repr(name if len(name) <= 80 else name[:77] + "...")


def resolve_trace_path(name: str, trace_dir: str | os.PathLike[str] | None) -> Path:
    """The real path of trace ``name`` under ``trace_dir``; ``TraceRefused`` when this agent reads
    no traces, or when ``name`` is absolute, climbs with ``..`` or leads outside ``trace_dir``
    through a symbolic link."""
    if trace_dir is None:
        raise TraceRefused(
            f"trace {_shown(name)}: this agent reads no trace files (start it with --trace-dir DIR "
            "to read traces under DIR)"
        )
    if not name or "\x00" in name or name.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", name):
        raise TraceRefused(
            f"trace {_shown(name)}: must be a path relative to this agent's trace directory, without '..'"
        )
    root = os.path.realpath(trace_dir)
    # realpath follows every link whether or not its target exists, so an outside target is refused
    # the same way in both cases.
    candidate = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, candidate]) != root:
        raise TraceRefused(f"trace {_shown(name)}: leads outside this agent's trace directory")
    return Path(candidate)
