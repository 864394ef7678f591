"""Job specs: the documented schema, parsing, and validation that names the key at fault.

A job spec describes one RL training run (see ``docs/job-spec.md``). It arrives as YAML or JSON
text, or as an already-decoded mapping (the REST layer), in one of two formats:

- dynarl's own format (top-level ``name``, ``model``, ``workload``, ``components``, ``policy``);
- RLinf's training config (top-level ``cluster`` with ``component_placement``), translated by
  ``jobs.rlinf``.

Both produce the same frozen ``JobSpec``. Every problem found is collected and raised together in
one ``SpecError`` whose ``errors`` carry key paths such as ``components[1].parallelism.tp``, so the
CLI can print them all and the REST layer can answer one 400 naming every field at fault.

A document is read within ``DocumentLimits`` (size, nesting depth, values with YAML aliases counted
as expanded, alias uses) before anything else is done with it, rank ranges are bounded before they
are expanded, integers are bounded to what the database columns hold, and messages quote values
cut short: no spec makes the parser work, allocate or answer without bound.

This module is used by the CLI and the node-side tools as well as by Django, so it must not import
Django.
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import os
import re
import reprlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import yaml

from scheduler.core.hypergraph import ComponentKind, Parallelism

SPEC_VERSION: Final = 1

JOB_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9._-]{1,100}")
COMPONENT_NAME_PATTERN: Final = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
BACKENDS: Final = ("sim", "ray")
WORKLOAD_KINDS: Final = ("math", "agentic")
SOURCE_FORMATS: Final = ("dynarl", "rlinf")
# Used only when the policy registry cannot be imported (e.g. a trimmed-down CLI install).
DEFAULT_POLICY_NAMES: Final = (
    "dynarl",
    "static-colocated",
    "static-disaggregated",
    "rlinf-auto",
    "bidirectional",
)
COLOCATED_POLICY: Final = "static-colocated"
# JSON objects open with a quoted key (or are empty); a YAML flow mapping ({name: job}) does not.
_JSON_OBJECT_START: Final = re.compile(r'\s*\{\s*["}]')
DEFAULT_POLICY: Final = "dynarl"

# A job's priority is stored in a 32-bit database column.
PRIORITY_MIN: Final = -(2**31)
PRIORITY_MAX: Final = 2**31 - 1
# Every other integer of a spec either lands in a 32-bit column (iterations, tp, pp, worker counts)
# or is used with them; one past this is refused at its key rather than by the database.
INTEGER_MAX: Final = 2**31 - 1
# The most GPU (or node) ranks one rank list may name, and GPUs an RLinf cluster may span; checked
# before a range is expanded, so "0-9999999" costs nothing.
MAX_GPU_RANKS: Final = 65_536
# Integer literals longer than this are refused while reading (Python's own limit is 4300 digits;
# YAML's base-60 integers cost quadratic time in their length).
MAX_INTEGER_CHARS: Final = 100
# At most this many problems are listed; the rest are counted.
MAX_REPORTED_PROBLEMS: Final = 50
MAX_TICK_SECONDS: Final = 3600.0
DEFAULT_MAX_TURNS: Final = 8
DEFAULT_TOOL_LATENCY_S: Final = 1.0

TOP_LEVEL_KEYS: Final = (
    "name",
    "priority",
    "backend",
    "model",
    "workload",
    "components",
    "policy",
    "tick_seconds",
)
MODEL_KEYS: Final = ("name", "params_b")
WORKLOAD_KEYS: Final = (
    "kind",
    "iterations",
    "prompts_per_iteration",
    "samples_per_prompt",
    "max_new_tokens",
    "staleness",
    "trace",
    "max_turns",
    "tool_latency_s",
)
AGENTIC_ONLY_KEYS: Final = ("max_turns", "tool_latency_s")
COMPONENT_KEYS: Final = (
    "name",
    "kind",
    "parallelism",
    "workers",
    "placement",
    "min_workers",
    "max_workers",
    "hardware",
    "depends_on",
    "colocated_with",
)
PARALLELISM_KEYS: Final = ("tp", "pp", "valid_dp")
POLICY_KEYS: Final = ("name", "params")


# -- errors ---------------------------------------------------------------------------------------


# Backstop for what a problem may quote: a path is built from keys the user wrote, a message may
# quote a value; neither may grow with the document.
MAX_PATH_CHARS: Final = 300
MAX_MESSAGE_CHARS: Final = 1000


@dataclass(frozen=True)
class FieldError:
    """One problem, at one key path (``""`` is the document itself); both are cut to a bounded
    length."""

    path: str
    message: str

    def __post_init__(self) -> None:
        if len(self.path) > MAX_PATH_CHARS:
            object.__setattr__(self, "path", self.path[: MAX_PATH_CHARS - 3] + "...")
        if len(self.message) > MAX_MESSAGE_CHARS:
            object.__setattr__(self, "message", self.message[: MAX_MESSAGE_CHARS - 3] + "...")

    def __str__(self) -> str:
        return f"{self.path or '(document)'}: {self.message}"

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "message": self.message}


class SpecError(ValueError):
    """A job spec that cannot be accepted; ``errors`` holds every problem found, not just the first
    (beyond ``MAX_REPORTED_PROBLEMS``, one last entry counts the rest)."""

    def __init__(self, errors: Iterable[FieldError]) -> None:
        self.errors: list[FieldError] = list(errors)
        if len(self.errors) > MAX_REPORTED_PROBLEMS:
            # A document of thousands of bad keys must not make an answer of thousands of lines.
            hidden = len(self.errors) - MAX_REPORTED_PROBLEMS
            self.errors = [
                *self.errors[:MAX_REPORTED_PROBLEMS],
                FieldError("", f"and {hidden} more problems not listed"),
            ]
        count = len(self.errors)
        lines = "\n".join(f"  {error}" for error in self.errors)
        super().__init__(f"invalid job spec ({count} problem{'s' if count != 1 else ''}):\n{lines}")

    @property
    def paths(self) -> list[str]:
        return [error.path for error in self.errors]

    def to_json(self) -> list[dict[str, str]]:
        return [error.to_json() for error in self.errors]


class RankError(ValueError):
    """A GPU rank list (``"0-3"``, ``"0-1,4-5"``, ``"all"``) that cannot be expanded."""


# -- bounds on the document -------------------------------------------------------------------------


@dataclass(frozen=True)
class DocumentLimits:
    """How big a spec document may be, checked while it is read and before anything else is done
    with it. The control plane takes them from its settings (``JOB_SPEC_MAX_*``)."""

    max_bytes: int = 1024 * 1024  # the text, UTF-8 encoded
    max_depth: int = 64  # nesting: the top-level mapping is level 1, its values level 2, ...
    max_nodes: int = 20_000  # keys, items and scalars, counting what YAML aliases repeat
    max_aliases: int = 200  # YAML alias uses (``*name``)


DEFAULT_LIMITS: Final = DocumentLimits()

# Values echoed in messages are cut to a few dozen characters: a message must never grow with the
# document (repr() of a structure an alias chain repeats a billion times never ends).
_SHORT: Final = reprlib.Repr()
_SHORT.maxstring = 60
_SHORT.maxother = 60
_SHORT.maxlong = 40
_SHORT.maxlevel = 2
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


def _shown(value: object) -> str:
    """repr() of a value given by the user, bounded in length."""
    return _SHORT.repr(value)


# -- the parsed spec --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params_b: float  # billions of parameters; sizes the trainer state a p2p migration moves

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "params_b": self.params_b}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelSpec:
        return cls(name=data["name"], params_b=float(data["params_b"]))


@dataclass(frozen=True)
class WorkloadSpec:
    """The data and batch shape of one RL iteration."""

    kind: str = "math"  # one of WORKLOAD_KINDS
    iterations: int = 10
    prompts_per_iteration: int = 512
    samples_per_prompt: int = 8
    max_new_tokens: int = 8192
    staleness: int = 0  # async bound: rollouts may lag the trainer by this many versions (0 = synchronous)
    trace: str | None = None  # JSONL trace of rollout lengths / turns (docs/trace-format.md)
    max_turns: int | None = None  # agentic only
    tool_latency_s: float | None = None  # agentic only

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "iterations": self.iterations,
            "prompts_per_iteration": self.prompts_per_iteration,
            "samples_per_prompt": self.samples_per_prompt,
            "max_new_tokens": self.max_new_tokens,
            "staleness": self.staleness,
            "trace": self.trace,
            "max_turns": self.max_turns,
            "tool_latency_s": self.tool_latency_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WorkloadSpec:
        return cls(
            kind=data["kind"],
            iterations=int(data["iterations"]),
            prompts_per_iteration=int(data["prompts_per_iteration"]),
            samples_per_prompt=int(data["samples_per_prompt"]),
            max_new_tokens=int(data["max_new_tokens"]),
            staleness=int(data["staleness"]),
            trace=data["trace"],
            max_turns=None if data["max_turns"] is None else int(data["max_turns"]),
            tool_latency_s=None if data["tool_latency_s"] is None else float(data["tool_latency_s"]),
        )


@dataclass(frozen=True)
class ComponentSpec:
    """One component (one WorkerGroup) at job start.

    Exactly one of ``workers`` (a count; admission picks the devices) and ``placement`` (explicit
    global GPU ranks, expanded and sorted) is set.
    """

    name: str
    kind: ComponentKind
    tp: int = 1
    pp: int = 1
    valid_dp: tuple[int, ...] = ()  # sorted; empty = any count between min and max
    workers: int | None = None
    placement: tuple[int, ...] | None = None
    min_workers: int = 1
    max_workers: int | None = None
    hardware: tuple[str, ...] = ()  # hardware types, best first; empty = any
    depends_on: tuple[str, ...] = ()
    colocated_with: tuple[str, ...] = ()  # components this one may share placement GPUs with

    @property
    def gpus_per_worker(self) -> int:
        return self.tp * self.pp

    @property
    def worker_count(self) -> int:
        if self.workers is not None:
            return self.workers
        assert self.placement is not None
        return len(self.placement) // self.gpus_per_worker

    @property
    def gpus(self) -> int:
        return self.worker_count * self.gpus_per_worker

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(tp=self.tp, pp=self.pp, valid_dp=self.valid_dp)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "tp": self.tp,
            "pp": self.pp,
            "valid_dp": list(self.valid_dp),
            "workers": self.workers,
            "placement": None if self.placement is None else list(self.placement),
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
            "hardware": list(self.hardware),
            "depends_on": list(self.depends_on),
            "colocated_with": list(self.colocated_with),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ComponentSpec:
        return cls(
            name=data["name"],
            kind=ComponentKind(data["kind"]),
            tp=int(data["tp"]),
            pp=int(data["pp"]),
            valid_dp=tuple(int(x) for x in data["valid_dp"]),
            workers=None if data["workers"] is None else int(data["workers"]),
            placement=None if data["placement"] is None else tuple(int(r) for r in data["placement"]),
            min_workers=int(data["min_workers"]),
            max_workers=None if data["max_workers"] is None else int(data["max_workers"]),
            hardware=tuple(data["hardware"]),
            depends_on=tuple(data["depends_on"]),
            colocated_with=tuple(data["colocated_with"]),
        )


@dataclass(frozen=True)
class PolicySpec:
    name: str = DEFAULT_POLICY
    params: Mapping[str, Any] = field(default_factory=dict)  # as given; the policy fills in defaults

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PolicySpec:
        return cls(name=data["name"], params=dict(data["params"]))


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: ModelSpec
    components: tuple[ComponentSpec, ...]
    priority: int = 0
    backend: str = "sim"
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    policy: PolicySpec = field(default_factory=PolicySpec)
    tick_seconds: float = 1.0
    source_format: str = "dynarl"  # one of SOURCE_FORMATS

    @property
    def total_gpus(self) -> int:
        """GPUs the job holds at start; GPUs shared by colocated components count once."""
        placed: set[int] = set()
        counted = 0
        for component in self.components:
            if component.placement is not None:
                placed.update(component.placement)
            else:
                counted += component.gpus
        return len(placed) + counted

    def component(self, name: str) -> ComponentSpec:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(name)

    def components_of(self, kind: ComponentKind) -> tuple[ComponentSpec, ...]:
        return tuple(c for c in self.components if c.kind is kind)

    def to_json(self) -> dict[str, Any]:
        return {
            "spec_version": SPEC_VERSION,
            "source_format": self.source_format,
            "name": self.name,
            "priority": self.priority,
            "backend": self.backend,
            "model": self.model.to_json(),
            "workload": self.workload.to_json(),
            "components": [c.to_json() for c in self.components],
            "policy": self.policy.to_json(),
            "tick_seconds": self.tick_seconds,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        """Load what ``to_json`` stored; a document of another spec version is refused."""
        version = data.get("spec_version")
        if version != SPEC_VERSION:
            raise SpecError([FieldError("spec_version", f"unsupported stored spec version {version!r}")])
        return cls(
            name=data["name"],
            priority=int(data["priority"]),
            backend=data["backend"],
            model=ModelSpec.from_json(data["model"]),
            workload=WorkloadSpec.from_json(data["workload"]),
            components=tuple(ComponentSpec.from_json(c) for c in data["components"]),
            policy=PolicySpec.from_json(data["policy"]),
            tick_seconds=float(data["tick_seconds"]),
            source_format=data["source_format"],
        )


# -- entry points ---------------------------------------------------------------------------------


def parse_spec(
    text_or_mapping: str | Mapping[str, Any],
    *,
    cluster_gpus: int | None = None,
    limits: DocumentLimits = DEFAULT_LIMITS,
) -> JobSpec:
    """Parse and validate a job spec (YAML or JSON text, or a decoded mapping).

    ``cluster_gpus``, when given, is the size of the cluster the job is for: explicit placements
    must fit inside it and ``"all"`` expands to it. ``limits`` bound the document (a mapping is
    checked against them too). Raises ``SpecError`` listing every problem.
    """
    if isinstance(text_or_mapping, str):
        document = load_document(text_or_mapping, limits=limits)
    else:
        document = text_or_mapping
        check_document_bounds(document, limits)
    if cluster_gpus is not None and (not _is_int(cluster_gpus) or cluster_gpus < 1):
        raise ValueError(f"cluster_gpus must be a positive integer, got {_shown(cluster_gpus)}")
    if not isinstance(document, Mapping):
        raise SpecError(
            [FieldError("", f"a job spec must be a mapping at the top level, got {_describe(document)}")]
        )
    # Imported here because jobs.rlinf builds on this module's helpers.
    from jobs import rlinf

    if rlinf.is_rlinf_config(document):
        return rlinf.translate_rlinf(document, cluster_gpus=cluster_gpus)
    return _parse_dynarl(document, cluster_gpus=cluster_gpus)


def parse_spec_file(
    path: str | os.PathLike[str], *, cluster_gpus: int | None = None, limits: DocumentLimits = DEFAULT_LIMITS
) -> JobSpec:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(limits.max_bytes + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([FieldError("", f"cannot read {os.fspath(path)!s}: {exc}")]) from exc
    return parse_spec(text, cluster_gpus=cluster_gpus, limits=limits)


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
        raise SpecError([FieldError("", f"JSON object has a duplicate key {_shown(exc.key)}")]) from exc
    except _NotJsonConstant as exc:
        raise SpecError([FieldError("", f"{exc.name} is not JSON (write a number)")]) from exc
    except json.JSONDecodeError as exc:
        raise SpecError(
            [FieldError("", f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}")]
        ) from exc
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, say
        raise SpecError([FieldError("", f"JSON value cannot be read: {_clip(str(exc))}")]) from exc
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
        return SpecError([FieldError("", f"YAML syntax error{_where(mark)}: {_clip(problem)}")])
    return SpecError([FieldError("", f"YAML syntax error: {_clip(str(exc))}")])


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
            raise _Refused(f"cannot read this value: {_clip(str(exc))}", node.start_mark) from exc

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
                    f"found duplicate key {_shown(key)}",
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
                        f"alias *{_clip(str(event.anchor))} refers to a node that contains it",
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


# -- GPU rank lists -------------------------------------------------------------------------------


def parse_gpu_ranks(value: object, limit: int | None, *, capacity: str | None = None) -> tuple[int, ...]:
    """Expand ``"0-3"``, ``"0-1,4-5"``, ``"0-3,6"``, ``"all"`` or a single integer into sorted ranks.

    ``limit`` is how many ranks exist (``None``: unknown, then ``"all"`` cannot be expanded and
    ranks are only checked against ``MAX_GPU_RANKS``); ``capacity`` describes them in messages
    (default "the cluster's N GPUs"). Every bound is checked before a range is expanded. Raises
    ``RankError``.
    """
    within = capacity if capacity is not None else f"the cluster's {limit} GPUs"
    if _is_int(value):
        assert isinstance(value, int)
        if value >= MAX_GPU_RANKS:  # also keeps str() away from integers of thousands of digits
            raise RankError(f"rank {_shown(value)} is above {MAX_GPU_RANKS - 1}, the highest a spec may name")
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise RankError(f'must be a rank list such as "0-3", "0-1,4-5" or "all", got {_describe(value)}')
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
            raise RankError(f"{_shown(part)} is not a rank or a range a-b (in {_shown(text)})")
        digits = max(len(match.group(1)), len(match.group(2) or ""))
        if digits > len(str(MAX_GPU_RANKS)):
            raise RankError(
                f"{_shown(part)} names a rank above {MAX_GPU_RANKS - 1}, the highest a spec may name"
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
                raise RankError(f"rank {rank} is listed twice in {_shown(text)}")
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


# -- reading sections with key paths (shared with jobs.rlinf) -------------------------------------


class _Marker:
    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return self.label


_ABSENT: Final = _Marker("<absent>")  # the key is not there
_REPORTED: Final = _Marker("<reported>")  # the value was bad and its problem is already recorded


def _is_int(value: object) -> bool:
    # bool is an int subclass; ``true`` where a count belongs is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if _is_int(value):
        return True
    return isinstance(value, float) and math.isfinite(value)


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, int):
        return f"an integer ({_shown(value)})"
    if isinstance(value, float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({shown!r})"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, for messages that quote something of unknown length."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _suggestion(key: str, allowed: Collection[str]) -> str:
    if len(key) > 100:  # no known name is that long; difflib's cost grows with the length
        return ""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class _Problems:
    """Collects every problem; the spec is rejected at the end if there is any."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def add(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def __bool__(self) -> bool:
        return bool(self.errors)

    def raise_if_any(self) -> None:
        if self.errors:
            raise SpecError(self.errors)


class _Section:
    """One mapping of the document, where it sits (its key path) and typed readers for its keys.

    The readers report a problem at the key's path and return ``None``; callers treat ``None``
    from a required or bad key as "already reported" and skip checks that depend on it.
    """

    def __init__(self, data: Mapping[Any, Any], path: str, problems: _Problems) -> None:
        self.data = data
        self.path = path
        self.problems = problems

    def path_of(self, key: str) -> str:
        return _join(self.path, key)

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str) -> Any:
        """The value as written, or ``_ABSENT``; a subclass may resolve references here."""
        return self.data.get(key, _ABSENT)

    def fail(self, key: str, message: str) -> None:
        self.problems.add(self.path_of(key), message)

    def reject_unknown(self, allowed: Sequence[str]) -> None:
        for key in self.data:
            if not isinstance(key, str):
                self.problems.add(self.path, f"keys must be strings, got {_describe(key)}")
            elif key not in allowed:
                self.fail(key, f"unknown key{_suggestion(key, allowed)} (allowed: {', '.join(allowed)})")

    def _present(self, key: str, required: bool) -> Any:
        value = self.raw(key)
        if value is _ABSENT and required:
            self.fail(key, "is required")
            return _REPORTED
        return value

    def integer(
        self,
        key: str,
        default: int | None = None,
        *,
        required: bool = False,
        nullable: bool = False,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int | None:
        value = self._present(key, required)
        if value is _ABSENT:
            return default
        if value is _REPORTED or (value is None and nullable):
            return None
        return _check_integer(self, key, value, minimum, maximum)

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        required: bool = False,
        nullable: bool = False,
        minimum: float | None = None,
        above: float | None = None,
        maximum: float | None = None,
    ) -> float | None:
        value = self._present(key, required)
        if value is _ABSENT:
            return default
        if value is _REPORTED or (value is None and nullable):
            return None
        if not _is_number(value):
            self.fail(key, f"must be a number, got {_describe(value)}")
            return None
        try:
            number = float(value)
        except OverflowError:  # an integer past what a float holds (over 10**308)
            self.fail(key, f"must be a number a float can hold, got {_shown(value)}")
            return None
        if above is not None and number <= above:
            self.fail(key, f"must be greater than {above:g}, got {_shown(value)}")
            return None
        if minimum is not None and number < minimum:
            self.fail(key, f"must be at least {minimum:g}, got {_shown(value)}")
            return None
        if maximum is not None and number > maximum:
            self.fail(key, f"must be at most {maximum:g}, got {_shown(value)}")
            return None
        return number

    def boolean(self, key: str, default: bool | None = None, *, required: bool = False) -> bool | None:
        value = self._present(key, required)
        if value is _ABSENT:
            return default
        if value is _REPORTED:
            return None
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {_describe(value)}")
            return None
        return value

    def string(
        self,
        key: str,
        default: str | None = None,
        *,
        required: bool = False,
        nullable: bool = False,
        choices: Sequence[str] | None = None,
        pattern: re.Pattern[str] | None = None,
        pattern_hint: str = "",
        max_length: int | None = None,
    ) -> str | None:
        value = self._present(key, required)
        if value is _ABSENT:
            return default
        if value is _REPORTED or (value is None and nullable):
            return None
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {_describe(value)}")
            return None
        if choices is not None:
            if value not in choices:
                self.fail(
                    key,
                    f"must be one of {', '.join(choices)}; got {_shown(value)}{_suggestion(value, choices)}",
                )
                return None
            return value
        if not value:
            self.fail(key, "must not be empty")
            return None
        if max_length is not None and len(value) > max_length:
            self.fail(key, f"must be at most {max_length} characters, got {len(value)}")
            return None
        if pattern is not None and pattern.fullmatch(value) is None:
            self.fail(key, f"{pattern_hint}; got {_shown(value)}")
            return None
        return value

    def child(self, data: Mapping[Any, Any], path: str) -> _Section:
        """A nested section; a subclass carries its own context along."""
        return _Section(data, path, self.problems)

    def mapping(self, key: str, *, required: bool = False) -> _Section | None:
        value = self._present(key, required)
        if value is _ABSENT or value is _REPORTED:
            return None
        if not isinstance(value, Mapping):
            self.fail(key, f"must be a mapping, got {_describe(value)}")
            return None
        return self.child(value, self.path_of(key))

    def sequence(self, key: str, *, required: bool = False) -> list[Any] | None:
        value = self._present(key, required)
        if value is _ABSENT or value is _REPORTED:
            return None
        if not isinstance(value, list | tuple):
            self.fail(key, f"must be a list, got {_describe(value)}")
            return None
        return list(value)

    def string_list(
        self, key: str, *, item_pattern: re.Pattern[str] | None = None, item_hint: str = ""
    ) -> tuple[tuple[int, str], ...] | None:
        """(position, string) for each good entry; bad or repeated entries are reported."""
        items = self.sequence(key)
        if items is None:
            return None if self.has(key) else ()
        good: list[tuple[int, str]] = []
        seen: set[str] = set()
        for position, item in enumerate(items):
            item_path = f"{self.path_of(key)}[{position}]"
            if not isinstance(item, str) or not item:
                self.problems.add(item_path, f"must be a non-empty string, got {_describe(item)}")
            elif item_pattern is not None and item_pattern.fullmatch(item) is None:
                self.problems.add(item_path, f"{item_hint}; got {_shown(item)}")
            elif item in seen:
                self.problems.add(item_path, f"{_shown(item)} is listed twice")
            else:
                seen.add(item)
                good.append((position, item))
        return tuple(good)


def _check_integer(
    section: _Section, key: str, value: Any, minimum: int | None, maximum: int | None
) -> int | None:
    if not _is_int(value):
        section.fail(key, f"must be an integer, got {_describe(value)}")
        return None
    assert isinstance(value, int)
    if minimum is not None and value < minimum:
        section.fail(key, f"must be at least {minimum}, got {_shown(value)}")
        return None
    # Unless told otherwise, what a 32-bit database column holds: 2**64 is a 400 here, not a 500
    # from PostgreSQL later.
    ceiling = INTEGER_MAX if maximum is None else maximum
    if value > ceiling:
        section.fail(key, f"must be at most {ceiling}, got {_shown(value)}")
        return None
    return value


# -- components: drafts and the cross-field checks (shared with jobs.rlinf) -----------------------


@dataclass
class _Draft:
    """A component as far as it parsed. ``None`` marks a field whose problem is already reported."""

    index: int
    name: str | None
    kind: ComponentKind | None
    tp: int | None = 1
    pp: int | None = 1
    valid_dp: tuple[int, ...] | None = ()
    workers: int | None = None
    placement: tuple[int, ...] | None = None
    uses_placement: bool = False  # placement (not workers) was given
    count_ok: bool = True  # the worker count or placement parsed
    min_workers: int | None = 1
    max_workers: int | None = None
    max_workers_ok: bool = True
    hardware: tuple[str, ...] | None = ()
    depends_on: tuple[tuple[int, str], ...] = ()  # (position in the list, name)
    colocated_with: tuple[tuple[int, str], ...] = ()

    @property
    def gpus_per_worker(self) -> int | None:
        return self.tp * self.pp if self.tp is not None and self.pp is not None else None

    @property
    def worker_count(self) -> int | None:
        if not self.count_ok:
            return None
        if not self.uses_placement:
            return self.workers
        per_worker = self.gpus_per_worker
        if self.placement is None or per_worker is None or len(self.placement) % per_worker:
            return None
        return len(self.placement) // per_worker

    def label(self) -> str:
        return f"component {self.name!r}" if self.name is not None else f"component #{self.index}"

    def build(self) -> ComponentSpec:
        """The final spec; only called once no problem at all was found."""
        assert self.name is not None and self.kind is not None
        assert self.tp is not None and self.pp is not None and self.valid_dp is not None
        assert self.min_workers is not None and self.hardware is not None
        return ComponentSpec(
            name=self.name,
            kind=self.kind,
            tp=self.tp,
            pp=self.pp,
            valid_dp=self.valid_dp,
            workers=None if self.uses_placement else self.workers,
            placement=self.placement if self.uses_placement else None,
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            hardware=self.hardware,
            depends_on=tuple(name for _, name in self.depends_on),
            colocated_with=tuple(name for _, name in self.colocated_with),
        )


class _ComponentPaths(Protocol):
    """Where a component's fields live in the source document, for error paths."""

    def components(self) -> str: ...

    def field(self, draft: _Draft, name: str) -> str: ...


class _DynarlPaths:
    def components(self) -> str:
        return "components"

    def field(self, draft: _Draft, name: str) -> str:
        if name == "count":
            name = "placement" if draft.uses_placement else "workers"
        return f"components[{draft.index}].{name}"


def _check_components(
    drafts: Sequence[_Draft],
    *,
    policy_name: str | None,
    cluster_gpus: int | None,
    problems: _Problems,
    paths: _ComponentPaths,
) -> None:
    """Cross-field checks over all components; each problem is reported where it can be fixed."""
    by_name: dict[str, _Draft] = {}
    for draft in drafts:
        if draft.name is None:
            continue
        if draft.name in by_name:
            first = by_name[draft.name]
            problems.add(
                paths.field(draft, "name"),
                f"duplicate component name {draft.name!r} (first used at {paths.field(first, 'name')})",
            )
        else:
            by_name[draft.name] = draft

    for draft in drafts:
        _check_worker_count(draft, problems, paths)
        _check_references(draft, by_name, problems, paths)

    _check_dependency_cycles(drafts, by_name, problems, paths)
    _check_shared_gpus(drafts, policy_name, problems, paths)
    _check_kinds(drafts, problems, paths)

    if cluster_gpus is not None and all(d.count_ok and d.gpus_per_worker is not None for d in drafts):
        placed: set[int] = set()
        counted = 0
        for draft in drafts:
            if draft.uses_placement and draft.placement is not None:
                placed.update(draft.placement)
            elif draft.workers is not None and draft.gpus_per_worker is not None:
                counted += draft.workers * draft.gpus_per_worker
        needed = len(placed) + counted
        if needed > cluster_gpus:
            problems.add(
                paths.components(), f"the job needs {needed} GPUs at start; the cluster has {cluster_gpus}"
            )


def _check_worker_count(draft: _Draft, problems: _Problems, paths: _ComponentPaths) -> None:
    count_path = paths.field(draft, "count")
    per_worker = draft.gpus_per_worker
    if (
        draft.uses_placement
        and draft.placement is not None
        and per_worker
        and len(draft.placement) % per_worker
    ):
        problems.add(
            count_path,
            f"{len(draft.placement)} GPUs ({format_gpu_ranks(draft.placement)}) are not a whole number of "
            f"workers of tp x pp = {per_worker} GPUs",
        )
        return
    count = draft.worker_count
    if (
        draft.min_workers is not None
        and draft.max_workers is not None
        and draft.min_workers > draft.max_workers
    ):
        problems.add(
            paths.field(draft, "max_workers"),
            f"must be at least min_workers ({draft.min_workers}), got {draft.max_workers}",
        )
        return
    if count is None:
        return
    if draft.min_workers is not None and count < draft.min_workers:
        problems.add(count_path, f"{count} workers is below min_workers ({draft.min_workers})")
    if draft.max_workers_ok and draft.max_workers is not None and count > draft.max_workers:
        problems.add(count_path, f"{count} workers is above max_workers ({draft.max_workers})")
    if draft.valid_dp and count not in draft.valid_dp:
        allowed = ", ".join(str(n) for n in draft.valid_dp)
        problems.add(count_path, f"{count} workers is not one of parallelism.valid_dp ({allowed})")


def _check_references(
    draft: _Draft, by_name: Mapping[str, _Draft], problems: _Problems, paths: _ComponentPaths
) -> None:
    for position, name in draft.depends_on:
        path = f"{paths.field(draft, 'depends_on')}[{position}]"
        if name == draft.name:
            problems.add(path, "a component cannot depend on itself")
        elif name not in by_name:
            problems.add(path, f"unknown component {_shown(name)}{_suggestion(name, by_name)}")
    if not draft.colocated_with:
        return
    if not draft.uses_placement:
        problems.add(
            paths.field(draft, "colocated_with"),
            "needs an explicit placement (GPU ranks) to share; a worker count lets admission choose devices",
        )
        return
    for position, name in draft.colocated_with:
        path = f"{paths.field(draft, 'colocated_with')}[{position}]"
        other = by_name.get(name)
        if name == draft.name:
            problems.add(path, "a component cannot be colocated with itself")
        elif other is None:
            problems.add(path, f"unknown component {_shown(name)}{_suggestion(name, by_name)}")
        elif not other.uses_placement:
            problems.add(
                path, f"component {_shown(name)} has a worker count, not an explicit placement to share"
            )
        elif (
            draft.placement is not None
            and other.placement is not None
            and not set(draft.placement) & set(other.placement)
        ):
            problems.add(
                path,
                f"shares no GPU with component {_shown(name)}; colocated components share placement ranks",
            )


def _check_dependency_cycles(
    drafts: Sequence[_Draft], by_name: Mapping[str, _Draft], problems: _Problems, paths: _ComponentPaths
) -> None:
    edges = {
        name: [dep for _, dep in draft.depends_on if dep in by_name and dep != name]
        for name, draft in by_name.items()
    }
    done: set[str] = set()
    reported: set[frozenset[str]] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = [*trail[trail.index(name) :], name]
            members = frozenset(cycle)
            if members not in reported:
                reported.add(members)
                problems.add(
                    paths.field(by_name[cycle[0]], "depends_on"), "dependency cycle: " + " -> ".join(cycle)
                )
            return
        if name in done:
            return
        trail.append(name)
        for dep in edges[name]:
            visit(dep, trail)
        trail.pop()
        done.add(name)

    for draft in drafts:
        if draft.name is not None and by_name.get(draft.name) is draft:
            visit(draft.name, [])


def _check_shared_gpus(
    drafts: Sequence[_Draft],
    policy_name: str | None,
    problems: _Problems,
    paths: _ComponentPaths,
) -> None:
    placed = [d for d in drafts if d.uses_placement and d.placement is not None and d.name is not None]
    for later_index, later in enumerate(placed):
        for earlier in placed[:later_index]:
            assert later.placement is not None and earlier.placement is not None
            shared = set(later.placement) & set(earlier.placement)
            if not shared or policy_name == COLOCATED_POLICY:
                continue
            marked = any(name == earlier.name for _, name in later.colocated_with) or any(
                name == later.name for _, name in earlier.colocated_with
            )
            if not marked:
                problems.add(
                    paths.field(later, "placement"),
                    f"shares GPUs {format_gpu_ranks(shared)} with {earlier.label()}; components may share GPUs "
                    f"only under policy {COLOCATED_POLICY} or when one lists the other in colocated_with",
                )


def _check_kinds(drafts: Sequence[_Draft], problems: _Problems, paths: _ComponentPaths) -> None:
    if not drafts or any(d.kind is None for d in drafts):
        return  # a component whose kind is unreadable might be the missing one
    actors = [d for d in drafts if d.kind is ComponentKind.ACTOR]
    if len(actors) != 1:
        names = f" ({', '.join(repr(d.name) for d in actors)})" if actors else ""
        problems.add(paths.components(), f"needs exactly one actor component, found {len(actors)}{names}")
    if not any(d.kind is ComponentKind.ROLLOUT for d in drafts):
        problems.add(paths.components(), "needs at least one rollout component")


# -- the policy (shared with jobs.rlinf) ----------------------------------------------------------


@dataclass(frozen=True)
class _PolicyRegistry:
    names: tuple[str, ...]
    # None when the registry is not importable: names are then known, parameters unchecked.
    build: Callable[..., object] | None


def _policy_registry() -> _PolicyRegistry:
    try:
        module = importlib.import_module("scheduler.core.policies")
    except ModuleNotFoundError as exc:
        if exc.name is None or not "scheduler.core.policies".startswith(exc.name):
            raise
        return _PolicyRegistry(DEFAULT_POLICY_NAMES, None)
    names = getattr(module, "POLICY_NAMES", None)
    build = getattr(module, "build_policy", None)
    if names is None or build is None:
        return _PolicyRegistry(DEFAULT_POLICY_NAMES, None)
    return _PolicyRegistry(tuple(names), build)


def _check_policy(
    name: str | None,
    params: Mapping[str, Any] | None,
    *,
    model_params_b: float | None,
    problems: _Problems,
    name_path: str,
    param_path: Callable[[str], str],
    params_path: str,
) -> None:
    """Unknown names at ``name_path``; a parameter the policy refuses at ``param_path(param)``."""
    registry = _policy_registry()
    if name is None:
        return
    if name not in registry.names:
        problems.add(
            name_path,
            f"unknown policy {_shown(name)}{_suggestion(name, registry.names)} (known: {', '.join(registry.names)})",
        )
        return
    if params is None:
        return
    if registry.build is None:
        for key, value in params.items():
            if not (isinstance(value, bool) or _is_number(value)):
                problems.add(param_path(key), f"must be a number or true/false, got {_describe(value)}")
        return
    from scheduler.core.costs import MigrationCostModel
    from scheduler.core.predictor import ThroughputPredictor

    # Only the parameters are being checked; a nominal size stands in for an invalid model size.
    cost_model = MigrationCostModel(model_params_b=model_params_b if model_params_b is not None else 1.0)
    build = registry.build

    def refused(given: Mapping[str, Any]) -> bool:
        try:
            build(name, predictor=ThroughputPredictor(), cost_model=cost_model, params=dict(given))
        except ValueError as exc:
            param = getattr(exc, "param", None)
            path = param_path(param) if isinstance(param, str) and param in given else params_path
            problems.add(path, str(exc))
            return True
        return False

    # One parameter at a time so every bad one is named (the policy stops at its first), then all
    # together for constraints between them.
    if not any([refused({key: value}) for key, value in params.items()]):
        refused(params)


# -- trace files (shared with jobs.rlinf) ----------------------------------------------------------


def trace_path_problem(path: str) -> str | None:
    """What is wrong with ``workload.trace`` as far as the control plane can tell, or None.

    A trace names a file under the trace directory of the agents that run the job (their
    ``--trace-dir``): a relative path that never climbs out of it. Each agent checks again where
    the path really leads (symbolic links included) before it opens anything."""
    if "\x00" in path:
        return "must not contain a NUL byte"
    if path.startswith(("/", "\\")):
        return (
            f"must be a path relative to the agents' trace directory (--trace-dir), not an absolute path; "
            f"got {_shown(path)}"
        )
    if ".." in re.split(r"[/\\]", path):
        return f"must not climb out of the agents' trace directory with '..'; got {_shown(path)}"
    return None


def check_trace(section: _Section, trace: str | None, key: str = "trace") -> str | None:
    """``trace`` when it may name a trace file, else None with the problem reported at ``key``."""
    if trace is None:
        return None
    problem = trace_path_problem(trace)
    if problem is not None:
        section.fail(key, problem)
        return None
    return trace


# -- dynarl's own format --------------------------------------------------------------------------


def _parse_dynarl(document: Mapping[Any, Any], *, cluster_gpus: int | None) -> JobSpec:
    problems = _Problems()
    top = _Section(document, "", problems)
    top.reject_unknown(TOP_LEVEL_KEYS)

    name = top.string(
        "name",
        required=True,
        pattern=JOB_NAME_PATTERN,
        pattern_hint="must be 1-100 characters of A-Z a-z 0-9 . _ -",
    )
    priority = top.integer("priority", 0, minimum=PRIORITY_MIN, maximum=PRIORITY_MAX)
    backend = top.string("backend", "sim", choices=BACKENDS)
    tick_seconds = top.number("tick_seconds", 1.0, above=0.0, maximum=MAX_TICK_SECONDS)

    model = _read_model(top.mapping("model", required=True))
    workload: WorkloadSpec | None = WorkloadSpec()
    if top.has("workload"):
        workload_section = top.mapping("workload")
        workload = _read_workload(workload_section) if workload_section is not None else None
    policy_name: str | None = DEFAULT_POLICY
    policy_params: dict[str, Any] | None = {}
    if top.has("policy"):
        policy_section = top.mapping("policy")
        policy_name, policy_params = (
            _read_policy(policy_section) if policy_section is not None else (None, None)
        )
    drafts = _read_components(top, cluster_gpus)

    _check_components(
        drafts, policy_name=policy_name, cluster_gpus=cluster_gpus, problems=problems, paths=_DynarlPaths()
    )
    _check_policy(
        policy_name,
        policy_params,
        model_params_b=model.params_b if model is not None else None,
        problems=problems,
        name_path="policy.name",
        param_path=lambda param: f"policy.params.{param}",
        params_path="policy.params",
    )
    problems.raise_if_any()
    assert name is not None and priority is not None and backend is not None and tick_seconds is not None
    assert (
        model is not None and workload is not None and policy_name is not None and policy_params is not None
    )
    return JobSpec(
        name=name,
        priority=priority,
        backend=backend,
        model=model,
        workload=workload,
        components=tuple(d.build() for d in drafts),
        policy=PolicySpec(name=policy_name, params=policy_params),
        tick_seconds=tick_seconds,
        source_format="dynarl",
    )


def _read_model(section: _Section | None) -> ModelSpec | None:
    if section is None:
        return None
    section.reject_unknown(MODEL_KEYS)
    name = section.string("name", required=True, max_length=200)
    params_b = section.number("params_b", required=True, above=0.0)
    if name is None or params_b is None:
        return None
    return ModelSpec(name=name, params_b=params_b)


def _read_workload(section: _Section) -> WorkloadSpec | None:
    section.reject_unknown(WORKLOAD_KEYS)
    kind = section.string("kind", "math", choices=WORKLOAD_KINDS)
    iterations = section.integer("iterations", 10, minimum=1)
    prompts = section.integer("prompts_per_iteration", 512, minimum=1)
    samples = section.integer("samples_per_prompt", 8, minimum=1)
    max_new_tokens = section.integer("max_new_tokens", 8192, minimum=1)
    staleness = section.integer("staleness", 0, minimum=0)
    trace = check_trace(section, section.string("trace", None, nullable=True, max_length=500))
    trace_ok = not section.has("trace") or section.raw("trace") is None or trace is not None
    max_turns: int | None = None
    tool_latency_s: float | None = None
    agentic_ok = True
    if kind == "agentic":
        max_turns = section.integer("max_turns", DEFAULT_MAX_TURNS, minimum=1)
        tool_latency_s = section.number("tool_latency_s", DEFAULT_TOOL_LATENCY_S, minimum=0.0)
        agentic_ok = max_turns is not None and tool_latency_s is not None
    elif kind is not None:
        for key in AGENTIC_ONLY_KEYS:
            if section.has(key):
                section.fail(key, f"only applies when workload.kind is agentic (it is {kind!r})")
    values = (kind, iterations, prompts, samples, max_new_tokens, staleness)
    if any(v is None for v in values) or not trace_ok or not agentic_ok:
        return None
    assert kind is not None and iterations is not None and prompts is not None and samples is not None
    assert max_new_tokens is not None and staleness is not None
    return WorkloadSpec(
        kind=kind,
        iterations=iterations,
        prompts_per_iteration=prompts,
        samples_per_prompt=samples,
        max_new_tokens=max_new_tokens,
        staleness=staleness,
        trace=trace,
        max_turns=max_turns,
        tool_latency_s=tool_latency_s,
    )


def _read_policy(section: _Section) -> tuple[str | None, dict[str, Any] | None]:
    section.reject_unknown(POLICY_KEYS)
    name = section.string("name", DEFAULT_POLICY)
    params_section = section.mapping("params")
    if params_section is None:
        return name, ({} if not section.has("params") else None)
    params: dict[str, Any] = {}
    keys_ok = True
    for key, value in params_section.data.items():
        if not isinstance(key, str):
            section.problems.add(
                params_section.path, f"parameter names must be strings, got {_describe(key)}"
            )
            keys_ok = False
        else:
            params[key] = value
    return name, params if keys_ok else None


def _read_components(top: _Section, cluster_gpus: int | None) -> list[_Draft]:
    items = top.sequence("components", required=True)
    if items is None:
        return []
    if not items:
        top.fail("components", "must list at least one component (an actor and a rollout)")
        return []
    drafts: list[_Draft] = []
    for index, item in enumerate(items):
        path = f"components[{index}]"
        if not isinstance(item, Mapping):
            top.problems.add(path, f"must be a mapping, got {_describe(item)}")
            continue
        drafts.append(_read_component(_Section(item, path, top.problems), index, cluster_gpus))
    return drafts


def _read_component(section: _Section, index: int, cluster_gpus: int | None) -> _Draft:
    section.reject_unknown(COMPONENT_KEYS)
    name = section.string(
        "name",
        required=True,
        pattern=COMPONENT_NAME_PATTERN,
        pattern_hint="must start with a letter and have at most 64 characters of A-Z a-z 0-9 _ -",
    )
    kind_text = section.string("kind", required=True, choices=[k.value for k in ComponentKind])
    draft = _Draft(index=index, name=name, kind=ComponentKind(kind_text) if kind_text is not None else None)

    parallelism = section.mapping("parallelism")
    if parallelism is not None:
        parallelism.reject_unknown(PARALLELISM_KEYS)
        draft.tp = parallelism.integer("tp", 1, minimum=1)
        draft.pp = parallelism.integer("pp", 1, minimum=1)
        draft.valid_dp = _read_valid_dp(parallelism)
    elif section.has("parallelism"):
        draft.tp = draft.pp = None
        draft.valid_dp = None

    has_workers, has_placement = section.has("workers"), section.has("placement")
    if has_workers and has_placement:
        section.problems.add(
            section.path, "workers and placement are mutually exclusive; give a count or explicit GPU ranks"
        )
        draft.count_ok = False
    elif not has_workers and not has_placement:
        section.problems.add(section.path, 'needs workers (a count) or placement (GPU ranks such as "0-3")')
        draft.count_ok = False
    elif has_workers:
        draft.workers = section.integer("workers", minimum=1)
        draft.count_ok = draft.workers is not None
    else:
        draft.uses_placement = True
        try:
            draft.placement = parse_gpu_ranks(section.raw("placement"), cluster_gpus)
        except RankError as exc:
            section.fail("placement", str(exc))
            draft.count_ok = False

    draft.min_workers = section.integer("min_workers", 1, minimum=0)
    draft.max_workers = section.integer("max_workers", None, nullable=True, minimum=1)
    draft.max_workers_ok = (
        not section.has("max_workers")
        or section.raw("max_workers") is None
        or (draft.max_workers is not None)
    )
    draft.hardware = _strings(section.string_list("hardware"))
    depends_on = section.string_list("depends_on")
    draft.depends_on = depends_on or ()
    colocated_with = section.string_list("colocated_with")
    draft.colocated_with = colocated_with or ()
    return draft


def _read_valid_dp(section: _Section) -> tuple[int, ...] | None:
    items = section.sequence("valid_dp")
    if items is None:
        return None if section.has("valid_dp") else ()
    sizes: set[int] = set()
    ok = True
    for position, item in enumerate(items):
        path = f"{section.path_of('valid_dp')}[{position}]"
        if not _is_int(item) or not 1 <= item <= INTEGER_MAX:
            section.problems.add(
                path, f"must be a positive integer up to {INTEGER_MAX}, got {_describe(item)}"
            )
            ok = False
        elif item in sizes:
            section.problems.add(path, f"{item} is listed twice")
            ok = False
        else:
            sizes.add(item)
    return tuple(sorted(sizes)) if ok else None


def _strings(entries: tuple[tuple[int, str], ...] | None) -> tuple[str, ...] | None:
    return None if entries is None else tuple(value for _, value in entries)
