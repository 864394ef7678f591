"""Job specs: the documented schema, parsing, and validation that names the key at fault.

A job spec describes one RL training run (see ``docs/job-spec.md``). It arrives as YAML or JSON
text, or as an already-decoded mapping (the REST layer), in one of two formats:

- dynarl's own format (top-level ``name``, ``model``, ``workload``, ``components``, ``policy``),
  read by ``jobs.spec.dynarl``;
- RLinf's training config (top-level ``cluster`` with ``component_placement``), translated by
  ``jobs.spec.rlinf``.

Both produce the same frozen ``JobSpec``. Every problem found is collected and raised together in
one ``SpecError`` whose ``errors`` carry key paths such as ``components[1].parallelism.tp``, so the
CLI can print them all and the REST layer can answer one 400 naming every field at fault.

A document is read within ``DocumentLimits`` (size, nesting depth, values with YAML aliases counted
as expanded, alias uses) before anything else is done with it, rank ranges are bounded before they
are expanded, integers are bounded to what the database columns hold, and messages quote values
cut short: no spec makes the parser work, allocate or answer without bound.

The modules, each importing only those listed before it:

- ``values``: how values given by the user are classified and quoted in messages;
- ``errors``: ``FieldError``, ``SpecError``, ``RankError`` and the ``Problems`` collector;
- ``document``: reading YAML or JSON text within ``DocumentLimits``;
- ``ranks``: GPU rank lists (``parse_gpu_ranks``, ``format_gpu_ranks``);
- ``model``: the frozen dataclasses of the parsed spec and the constants of what it may say;
- ``sections``: ``Section``, the typed reader of one mapping with key paths, used by both formats;
- ``components``: a component's draft and the checks across components;
- ``policy``: the policy name and parameters checked against the policy registry;
- ``workload``: the workload reader both formats share, and trace paths;
- ``runtime``: the ``runtime`` section of a job on the ``ray`` backend, and its rules;
- ``dynarl`` and ``rlinf``: the two formats;
- ``parse``: the entry points, which recognise the format.

This package is used by the CLI and the node-side tools as well as by Django, so it must not import
Django.
"""

from jobs.spec.document import (
    DEFAULT_LIMITS,
    DocumentLimits,
    check_document_bounds,
    compose_yaml,
    load_document,
    load_json,
)
from jobs.spec.errors import (
    MAX_MESSAGE_CHARS,
    MAX_PATH_CHARS,
    MAX_REPORTED_PROBLEMS,
    FieldError,
    RankError,
    SpecError,
)
from jobs.spec.model import (
    BACKENDS,
    SPEC_VERSION,
    ComponentSpec,
    JobSpec,
    ModelSpec,
    PolicySpec,
    RuntimeModelSpec,
    RuntimeSpec,
    WorkloadSpec,
)
from jobs.spec.parse import parse_spec, parse_spec_file
from jobs.spec.ranks import MAX_GPU_RANKS, format_gpu_ranks, parse_gpu_ranks
from jobs.spec.sections import INTEGER_MAX

__all__ = [
    "BACKENDS",
    "DEFAULT_LIMITS",
    "INTEGER_MAX",
    "MAX_GPU_RANKS",
    "MAX_MESSAGE_CHARS",
    "MAX_PATH_CHARS",
    "MAX_REPORTED_PROBLEMS",
    "SPEC_VERSION",
    "ComponentSpec",
    "DocumentLimits",
    "FieldError",
    "JobSpec",
    "ModelSpec",
    "PolicySpec",
    "RankError",
    "RuntimeModelSpec",
    "RuntimeSpec",
    "SpecError",
    "WorkloadSpec",
    "check_document_bounds",
    "compose_yaml",
    "format_gpu_ranks",
    "load_document",
    "load_json",
    "parse_gpu_ranks",
    "parse_spec",
    "parse_spec_file",
]
