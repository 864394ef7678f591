"""The entry points: a spec's document is read within its limits, its format recognised, and the
format's reader builds the ``JobSpec``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jobs.spec.document import DEFAULT_LIMITS, DocumentLimits, check_document_bounds, load_document
from jobs.spec.dynarl import parse_dynarl
from jobs.spec.errors import FieldError, SpecError
from jobs.spec.model import JobSpec
from jobs.spec.rlinf import is_rlinf_config, translate_rlinf
from jobs.spec.values import describe, is_int, shown


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
    if cluster_gpus is not None and (not is_int(cluster_gpus) or cluster_gpus < 1):
        raise ValueError(f"cluster_gpus must be a positive integer, got {shown(cluster_gpus)}")
    if not isinstance(document, Mapping):
        raise SpecError(
            [FieldError("", f"a job spec must be a mapping at the top level, got {describe(document)}")]
        )
    if is_rlinf_config(document):
        return translate_rlinf(document, cluster_gpus=cluster_gpus)
    return parse_dynarl(document, cluster_gpus=cluster_gpus)


def parse_spec_file(
    path: str | os.PathLike[str], *, cluster_gpus: int | None = None, limits: DocumentLimits = DEFAULT_LIMITS
) -> JobSpec:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(limits.max_bytes + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([FieldError("", f"cannot read {os.fspath(path)!s}: {exc}")]) from exc
    return parse_spec(text, cluster_gpus=cluster_gpus, limits=limits)
