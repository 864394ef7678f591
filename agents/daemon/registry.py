"""Execution backends by name.

A registry entry names a callable as ``"module:attribute"``; it is imported only when chosen, so a
host without Ray never imports it. ``--backend`` also takes ``module:attribute`` directly, for a
backend that lives outside this package. The callable gets the backend options as keyword
arguments, ``host=<node name>`` when it takes a ``host`` parameter, and ``trace_dir=<the agent's
--trace-dir>`` when one is set and it takes a ``trace_dir`` parameter.

A backend runs jobs of one or more job backends (a job spec's ``backend``): those named by its
``offers`` attribute when it has one, else its ``name`` (the sim backend offers ``sim``, the ray
backend ``ray``). The agent registers them, and the control plane places a job only on nodes that
offer its backend.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from agents.backends.base import BackendUnavailable, ExecutionBackend

BACKENDS: dict[str, str] = {
    "sim": "agents.backends.sim.backend:SimBackend",
    "ray": "agents.backends.ray.backend:RayBackend",
}
REQUIRED = (
    "name",
    "inventory",
    "launch_workers",
    "stop_workers",
    "execute_step",
    "telemetry",
    "observe_control",
    "running_workers",
    "close",
)


class BackendError(RuntimeError):
    """The backend could not be found or built."""


def _resolve(spec: str) -> Callable[..., Any]:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise BackendError(f"{spec!r} is neither a known backend ({', '.join(BACKENDS)}) nor module:callable")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendError(f"cannot import backend module {module_name}: {exc}") from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise BackendError(f"{module_name} has no callable {attribute}")
    return cast(Callable[..., Any], factory)


def _accepts(factory: Callable[..., Any], name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def offered_backends(backend: ExecutionBackend) -> tuple[str, ...]:
    """The job backends ``backend`` runs, as the agent registers them."""
    offers = getattr(backend, "offers", None)
    if offers is None:
        return (str(backend.name),)
    if isinstance(offers, str) or not all(isinstance(o, str) for o in offers) or not offers:
        raise BackendError(
            f"backend {backend.name!r}: offers must be a non-empty list of names, got {offers!r}"
        )
    return tuple(dict.fromkeys(offers))


def load_backend(
    name: str, *, host: str, options: Mapping[str, Any], trace_dir: Path | None = None
) -> ExecutionBackend:
    """Build the backend ``name`` (a registry name or ``module:callable``) with ``options``."""
    factory = _resolve(BACKENDS.get(name, name))
    kwargs = dict(options)
    if "host" not in kwargs and _accepts(factory, "host"):
        kwargs["host"] = host
    if trace_dir is not None and "trace_dir" not in kwargs and _accepts(factory, "trace_dir"):
        kwargs["trace_dir"] = str(trace_dir)
    try:
        backend = factory(**kwargs)
    except (TypeError, ValueError) as exc:
        raise BackendError(f"backend {name!r} refused its options {sorted(options)}: {exc}") from exc
    except BackendUnavailable as exc:
        raise BackendError(f"backend {name!r} cannot start: {exc}") from exc
    missing = [attr for attr in REQUIRED if not hasattr(backend, attr)]
    if missing:
        raise BackendError(f"backend {name!r} lacks {', '.join(missing)} of the ExecutionBackend interface")
    return cast(ExecutionBackend, backend)
