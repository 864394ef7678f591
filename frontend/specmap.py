"""Where a key path of a job spec sits in its text, so the submit form can mark the line of each
error the API names (``components[1].parallelism.tp``, ``cluster.component_placement.actor``).

The text is composed (not loaded) with PyYAML, which keeps each node's position; JSON is read the
same way, being YAML's flow style. Composition is bounded by the spec limits, as at submission. A path that goes past what the text holds (a missing key) is
placed at the deepest part of it that exists, where the key would have to be added.
"""

from __future__ import annotations

import re

import yaml

from jobs.spec import DEFAULT_LIMITS, DocumentLimits, SpecError, compose_yaml

SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
LINE_IN_MESSAGE = re.compile(r"\bline (\d+)\b")


def path_segments(path: str) -> list[str | int]:
    """``components[1].parallelism.tp`` -> ``["components", 1, "parallelism", "tp"]``."""
    return [int(index) if index else key for key, index in SEGMENT.findall(path)]


def _child(node: yaml.Node, segment: str | int) -> tuple[yaml.Node, int] | None:
    """The node at ``segment`` under ``node`` and the 0-based line to show for it."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == str(segment):
                # A key whose value is a nested block reads best at the key's own line.
                where = value if isinstance(value, yaml.ScalarNode) else key
                return value, int(where.start_mark.line)
        return None
    if isinstance(node, yaml.SequenceNode):
        items: list[yaml.Node] = list(node.value)
        if isinstance(segment, int):
            if 0 <= segment < len(items):
                return items[segment], int(items[segment].start_mark.line)
            return None
        # Components may be named in a path: the list item whose ``name`` is the segment.
        for item in items:
            name = _child(item, "name")
            if name is not None and isinstance(name[0], yaml.ScalarNode) and name[0].value == segment:
                return item, int(item.start_mark.line)
    return None


def _compose(text: str, limits: DocumentLimits) -> yaml.Node | None:
    """The node tree, composed within the spec limits (so no text can exhaust the stack or the
    memory here either); None when the text does not parse."""
    try:
        return compose_yaml(text, limits=limits)
    except SpecError:
        return None


def _line_in(root: yaml.Node, path: str) -> int:
    node, line = root, int(root.start_mark.line)
    for segment in path_segments(path):
        child = _child(node, segment)
        if child is None:
            break
        node, line = child
    return line + 1


def line_of(text: str, path: str, *, limits: DocumentLimits = DEFAULT_LIMITS) -> int | None:
    """The 1-based line of ``path`` in ``text``; None when the text does not parse."""
    root = _compose(text, limits)
    return None if root is None else _line_in(root, path)


def error_lines(
    text: str, problems: list[tuple[str, str]], *, limits: DocumentLimits = DEFAULT_LIMITS
) -> list[int | None]:
    """The line of each (path, message) problem: the path's line, or for a problem with the
    document itself (a syntax error), the line its message names. The text is composed once."""
    root = _compose(text, limits) if any(path for path, _ in problems) else None
    lines: list[int | None] = []
    for path, message in problems:
        if path:
            lines.append(None if root is None else _line_in(root, path))
            continue
        mentioned = LINE_IN_MESSAGE.search(message)
        lines.append(int(mentioned.group(1)) if mentioned else None)
    return lines
