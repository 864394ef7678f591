"""Reading a spec document (YAML or JSON text) within ``DocumentLimits``: size, nesting depth,
values with YAML aliases counted as expanded, and alias uses are checked while it is read and
before anything else is done with it; a key written twice is refused in both languages."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import yaml

from jobs.spec.errors import FieldError, SpecError
from jobs.spec.values import clip, shown

# JSON objects open with a quoted key (or are empty); a YAML flow mapping ({name: job}) does not.
_JSON_OBJECT_START: Final = re.compile(r'\s*\{\s*["}]')
# Integer literals longer than this are refused while reading (Python's own limit is 4300 digits;
# YAML's base-60 integers cost quadratic time in their length).
MAX_INTEGER_CHARS: Final = 100


@dataclass(frozen=True)
class DocumentLimits:
    """How big a spec document may be, checked while it is read and before anything else is done
    with it. The control plane takes them from its settings (``JOB_SPEC_MAX_*``)."""

    max_bytes: int = 1024 * 1024  # the text, UTF-8 encoded
    max_depth: int = 64  # nesting: the top-level mapping is level 1, its values level 2, ...
    max_nodes: int = 20_000  # keys, items and scalars, counting what YAML aliases repeat
    max_aliases: int = 200  # YAML alias uses (``*name``)


DEFAULT_LIMITS: Final = DocumentLimits()


def load_document(text: str, *, limits: DocumentLimits = DEFAULT_LIMITS) -> Any:
    """Decode YAML or JSON text within ``limits``; syntax errors, duplicate keys and documents
    over a limit become a ``SpecError`` at path ""."""
    _check_size(text, limits)
    if not text.strip():
        raise SpecError([FieldError("", "the document is empty")])
    if _JSON_OBJECT_START.match(text):
        return load_json(text, limits=limits)
    return _load_yaml(text, limits)


def load_json(text: str, *, limits: DocumentLimits = DEFAULT_LIMITS) -> Any:
    """Decode JSON text within ``limits``, refusing a key written twice in one object (as YAML's
    loader does). Nesting is measured before decoding, so deep nesting cannot exhaust the stack."""
    _check_size(text, limits)
    deepest = _json_nesting(text, limits.max_depth)
    if deepest > limits.max_depth:
        raise SpecError([_too_deep(limits)])
    try:
        document = json.loads(
            text, object_pairs_hook=_json_object_without_duplicates, parse_constant=_json_constant
        )
    except _DuplicateKeyError as exc:
        raise SpecError([FieldError("", f"JSON object has a duplicate key {shown(exc.key)}")]) from exc
    except _NotJsonConstant as exc:
        raise SpecError([FieldError("", f"{exc.name} is not JSON (write a number)")]) from exc
    except json.JSONDecodeError as exc:
        raise SpecError(
            [FieldError("", f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}")]
        ) from exc
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, say
        raise SpecError([FieldError("", f"JSON value cannot be read: {clip(str(exc))}")]) from exc
    check_document_bounds(document, limits)
    return document


def check_document_bounds(document: object, limits: DocumentLimits = DEFAULT_LIMITS) -> None:
    """Refuse a decoded document nested deeper or holding more values than ``limits`` allow.

    Iterative and stopping at the limit, so shared or even cyclic structures (a YAML alias chain
    as Python objects) cost at most ``max_nodes`` steps."""
    nodes = 0
    stack: list[tuple[object, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if depth > limits.max_depth:
            raise SpecError([_too_deep(limits)])
        if isinstance(value, Mapping):
            children: list[object] = [part for pair in value.items() for part in pair]
        elif isinstance(value, list | tuple):
            children = list(value[: limits.max_nodes + 1])
        else:
            children = []
        if nodes + len(stack) + len(children) > limits.max_nodes:
            raise SpecError([_too_many_nodes(limits)])
        stack.extend((child, depth + 1) for child in children)


def compose_yaml(text: str, *, limits: DocumentLimits = DEFAULT_LIMITS) -> yaml.Node | None:
    """The YAML node tree of ``text`` (positions kept, nothing constructed), within ``limits``."""
    _check_size(text, limits)
    node: yaml.Node | None = _read_yaml(text, limits, _BoundedSafeLoader.get_single_node)
    return node


def _check_size(text: str, limits: DocumentLimits) -> None:
    # UTF-8 takes at most 4 bytes a character, so only a text near the limit needs encoding to tell.
    if len(text) > limits.max_bytes or (
        len(text) * 4 > limits.max_bytes and len(text.encode("utf-8", "surrogatepass")) > limits.max_bytes
    ):
        raise SpecError(
            [FieldError("", f"the document is larger than {limits.max_bytes} bytes, the most a spec may be")]
        )


def _too_deep(limits: DocumentLimits) -> FieldError:
    return FieldError("", f"the document nests deeper than {limits.max_depth} levels, the most a spec may")


def _too_many_nodes(limits: DocumentLimits) -> FieldError:
    return FieldError(
        "",
        f"the document holds more than {limits.max_nodes} values (keys, items and scalars, counting what "
        "YAML aliases repeat), the most a spec may",
    )


# A JSON string (escapes included) and the brackets outside strings; a linear scan, no recursion.
_JSON_STRING: Final = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_BRACKET: Final = re.compile(r"[\[\]{}]")


def _json_nesting(text: str, limit: int) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (scalars not counted), stopping
    once past ``limit``; for text that is not JSON, a harmless over-estimate."""
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        else:
            depth -= 1
    return deepest


def _where(mark: Any, *, parenthesised: bool = False) -> str:  # one of PyYAML's two Mark types, or None
    if mark is None:
        return ""
    where = f"at line {mark.line + 1}, column {mark.column + 1}"
    return f" ({where})" if parenthesised else f" {where}"


def _yaml_syntax_error(exc: yaml.YAMLError) -> SpecError:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        return SpecError([FieldError("", f"YAML syntax error{_where(mark)}: {clip(problem)}")])
    return SpecError([FieldError("", f"YAML syntax error: {clip(str(exc))}")])


def _read_yaml(text: str, limits: DocumentLimits, read: Callable[[_BoundedSafeLoader], Any]) -> Any:
    """``read`` (compose or construct) ``text`` with a bounded loader; refusals and syntax errors
    become a SpecError."""
    loader = _BoundedSafeLoader(text, limits)
    try:
        return read(loader)
    except _Refused as exc:
        raise SpecError([FieldError("", f"{exc.message}{_where(exc.mark, parenthesised=True)}")]) from exc
    except yaml.YAMLError as exc:
        raise _yaml_syntax_error(exc) from exc
    finally:
        loader.dispose()


def _load_yaml(text: str, limits: DocumentLimits) -> Any:
    # A SafeLoader subclass: safe_load semantics.
    document = _read_yaml(text, limits, _BoundedSafeLoader.get_single_data)
    if document is None:
        raise SpecError([FieldError("", "the document is empty")])
    return document


class _NotJsonConstant(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _json_constant(name: str) -> float:
    # Python's json reads NaN and Infinity, which JSON does not have (DRF's parser refuses them too).
    raise _NotJsonConstant(name)


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _json_object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


class _Refused(Exception):
    """A YAML document refused while being read: past one of its ``DocumentLimits``, or holding
    a value Python cannot build."""

    def __init__(self, message: str, mark: Any) -> None:  # PyYAML's Mark (pure or libyaml) or None
        super().__init__(message)
        self.message = message
        self.mark = mark


_INT_TAG: Final = "tag:yaml.org,2002:int"


class _StrictSafeLoader(yaml.SafeLoader):
    """``yaml.safe_load`` semantics, but a key written twice is an error instead of last-one-wins,
    and a value Python cannot build (``2024-13-45``, an integer of a thousand digits) is an error
    at its line rather than an exception of another kind."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        if isinstance(node, yaml.ScalarNode) and node.tag == _INT_TAG and len(node.value) > MAX_INTEGER_CHARS:
            raise _Refused(f"an integer of more than {MAX_INTEGER_CHARS} characters", node.start_mark)
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as exc:
            raise _Refused(f"cannot read this value: {clip(str(exc))}", node.start_mark) from exc

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key; the base constructor reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {shown(key)}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


class _BoundedSafeLoader(_StrictSafeLoader):
    """Composes within ``DocumentLimits``: nesting depth, alias uses, and values counted as if
    every alias were expanded (an alias adds the size of the node it names), so an alias chain
    that would expand to billions of values is refused after ``max_nodes``, before anything is
    built. The composer is where PyYAML resolves aliases and where it recurses."""

    def __init__(self, stream: str, limits: DocumentLimits) -> None:
        super().__init__(stream)
        self.limits = limits
        self._depth = 0
        self._nodes = 0
        self._aliases = 0
        self._sizes: dict[Any, int] = {}  # anchor -> expanded size of its node, once composed

    def _count(self, nodes: int, mark: Any) -> None:
        self._nodes += nodes
        if self._nodes > self.limits.max_nodes:
            raise _Refused(_too_many_nodes(self.limits).message, mark)

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # untyped in PyYAML's stubs
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.anchors:  # an undefined one is reported by the composer
                size = self._sizes.get(event.anchor)
                if size is None:
                    raise _Refused(
                        f"alias *{clip(str(event.anchor))} refers to a node that contains it",
                        event.start_mark,
                    )
                self._aliases += 1
                if self._aliases > self.limits.max_aliases:
                    raise _Refused(
                        f"the document uses more than {self.limits.max_aliases} aliases, the most a spec may",
                        event.start_mark,
                    )
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > self.limits.max_depth:
            raise _Refused(_too_deep(self.limits).message, event.start_mark)
        before = self._nodes
        self._count(1, event.start_mark)
        node = super().compose_node(parent, index)
        self._depth -= 1
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._sizes[anchor] = self._nodes - before
        return node
