"""The agent's configuration: command-line flags first, then ``DYNARL_*`` environment variables,
then defaults. Every problem is collected and reported together, naming the flag and variable."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agents.backends.faults import (
    AGENT_FAULTS_ENV,
    AGENT_FAULTS_FILE_ENV,
    FAULT_FILE_ERRORS,
    Fault,
    FaultSpecError,
    parse_faults,
    read_fault_file,
)

# What the control plane accepts as a node name (agents.services.registration.HOST_NAME): checked
# here too so a bad host name is refused before the agent starts, not at every registration attempt.
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class ConfigError(ValueError):
    """Bad configuration; ``problems`` holds one line per setting at fault."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class AgentConfig:
    url: str  # the control plane's base URL, e.g. http://dynarl.internal:8000
    bootstrap_token: str  # "" when the agent relies on the node token it already holds
    backend: str  # a registry name (sim, ray) or "module:callable"
    host: str
    state_dir: Path
    backend_options: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    heartbeat_interval_s: float = 1.0  # until the control plane says otherwise at registration
    poll_wait_s: float = 25.0
    shutdown_grace_s: float = 30.0
    retry_base_s: float = 0.5
    retry_max_s: float = 30.0
    max_buffered_samples: int = 100_000
    nvml: bool = True
    log_level: str = "INFO"
    trace_dir: Path | None = None  # job traces (workload.trace) are read from under it only; None: none
    # injected into migration steps, for fault drills (agents/backends/faults.py); none by default
    faults: tuple[Fault, ...] = ()
    # a fault list read again before every step, so a drill arms a running agent; None: none
    faults_file: Path | None = None


def default_state_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "dynarl-agent"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynarl-agent",
        description="The dynarl node agent: registers this host with the control plane, streams "
        "its telemetry and carries out the control plane's commands through an execution backend.",
    )
    add = parser.add_argument
    add("--url", help="control plane base URL (env DYNARL_URL)")
    add("--bootstrap-token", help="bootstrap token to register with (env DYNARL_BOOTSTRAP_TOKEN)")
    add(
        "--bootstrap-token-file",
        help="read the bootstrap token from this file, keeping it off the command line "
        "(env DYNARL_BOOTSTRAP_TOKEN_FILE)",
    )
    add("--backend", help="execution backend: sim, ray or module:callable (env DYNARL_BACKEND; default sim)")
    add(
        "--backend-option",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="option passed to the backend, repeatable; VALUE is read as JSON when it parses "
        "(env DYNARL_BACKEND_OPTIONS: comma-separated KEY=VALUE, or a JSON object)",
    )
    add("--host", help="node name to register as (env DYNARL_HOST; default this machine's host name)")
    add("--state-dir", help="node token and command journal (env DYNARL_STATE_DIR)")
    add(
        "--trace-dir",
        help="the directory job traces (workload.trace, relative paths) are read from; a trace "
        "leading outside it is refused (env DYNARL_TRACE_DIR; default: none, no trace is read)",
    )
    add(
        "--label",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="node label, repeatable (env DYNARL_LABELS, comma-separated)",
    )
    add(
        "--heartbeat-interval",
        help="seconds between heartbeats until the control plane sets it (env DYNARL_HEARTBEAT_INTERVAL_S)",
    )
    add("--poll-wait", help="long-poll wait in seconds (env DYNARL_POLL_WAIT_S; default 25)")
    add(
        "--shutdown-grace",
        help="seconds to finish the step in hand on SIGTERM before reporting it failed "
        "(env DYNARL_SHUTDOWN_GRACE_S; default 30)",
    )
    add("--retry-max", help="longest backoff between retries, seconds (env DYNARL_RETRY_MAX_S; default 30)")
    add(
        "--max-buffered-samples",
        help="worker samples kept while the control plane is unreachable (env DYNARL_MAX_BUFFERED_SAMPLES)",
    )
    add(
        "--no-nvml",
        action="store_true",
        default=None,
        help="never read devices through NVML, even where a driver is present (env DYNARL_NVML=0)",
    )
    add("--log-level", help="DEBUG, INFO, WARNING or ERROR (env DYNARL_LOG_LEVEL; default INFO)")
    add(
        "--faults",
        help="fault drill: make migration steps fail, hang or kill this agent, e.g. "
        "'crash:transfer_state@1' (env DYNARL_AGENT_FAULTS; default none; agents/backends/faults.py)",
    )
    add(
        "--faults-file",
        help="fault drill: a file of faults as for --faults, read again before every step, so a "
        "drill arms or disarms the running agent by rewriting it (env DYNARL_AGENT_FAULTS_FILE; "
        "default none)",
    )
    return parser


def _pick(flag: Any, environ: Mapping[str, str], variable: str) -> str | None:
    if flag is not None:
        return str(flag)
    value = environ.get(variable)
    return value if value not in (None, "") else None


def _pairs(items: Sequence[str], what: str, problems: list[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"{what}: {item!r} is not KEY=VALUE")
            continue
        pairs[key.strip()] = value.strip()
    return pairs


def _split(raw: str | None) -> list[str]:
    return [part for part in (raw or "").split(",") if part.strip()]


def option_value(raw: str) -> Any:
    """``8`` -> 8, ``true`` -> True, ``1.5`` -> 1.5, anything that is not JSON stays a string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _backend_options(flags: list[str] | None, env: str | None, problems: list[str]) -> dict[str, Any]:
    """From ``--backend-option k=v`` flags, else DYNARL_BACKEND_OPTIONS: a JSON object, or
    comma-separated ``k=v`` pairs (a value holding a comma needs the JSON form)."""
    what = "--backend-option / DYNARL_BACKEND_OPTIONS"
    if flags is None and env and env.lstrip().startswith("{"):
        try:
            options = json.loads(env)
        except json.JSONDecodeError as exc:
            problems.append(f"{what}: not a JSON object: {exc}")
            return {}
        if not isinstance(options, dict):
            problems.append(f"{what}: not a JSON object")
            return {}
        return options
    raw = flags if flags is not None else _split(env)
    return {key: option_value(value) for key, value in _pairs(raw, what, problems).items()}


def _number(
    raw: str | None, default: float, name: str, problems: list[str], *, low: float, allow_low: bool = False
) -> float:
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        problems.append(f"{name}: {raw!r} is not a number")
        return default
    if not math.isfinite(value) or not (value >= low if allow_low else value > low):
        problems.append(f"{name}: must be {'at least' if allow_low else 'above'} {low:g}")
        return default
    return value


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """The agent's configuration from ``argv`` (without the program name) and ``environ``;
    raises ConfigError naming every bad setting. ``--help`` exits through argparse."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    problems: list[str] = []

    url = (_pick(args.url, environ, "DYNARL_URL") or "").rstrip("/")
    parts = urlsplit(url)
    if not url:
        problems.append("--url / DYNARL_URL: the control plane's URL is required")
    elif parts.scheme not in ("http", "https") or not parts.netloc:
        problems.append(f"--url / DYNARL_URL: {url!r} is not an http(s) URL")

    token = _pick(args.bootstrap_token, environ, "DYNARL_BOOTSTRAP_TOKEN") or ""
    token_file = _pick(args.bootstrap_token_file, environ, "DYNARL_BOOTSTRAP_TOKEN_FILE")
    if token_file and not token:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            problems.append(f"--bootstrap-token-file / DYNARL_BOOTSTRAP_TOKEN_FILE: cannot read it: {exc}")

    backend = _pick(args.backend, environ, "DYNARL_BACKEND") or "sim"
    backend_options = _backend_options(args.backend_option, environ.get("DYNARL_BACKEND_OPTIONS"), problems)
    raw_labels = args.label if args.label is not None else _split(environ.get("DYNARL_LABELS"))
    labels = _pairs(raw_labels, "--label / DYNARL_LABELS", problems)

    host = _pick(args.host, environ, "DYNARL_HOST") or socket.gethostname()
    if not HOST_NAME.match(host):
        problems.append(
            f"--host / DYNARL_HOST: {host!r} must be letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 200 characters"
        )

    state_raw = _pick(args.state_dir, environ, "DYNARL_STATE_DIR")
    state_dir = Path(state_raw).expanduser() if state_raw else default_state_dir(environ)
    trace_raw = _pick(args.trace_dir, environ, "DYNARL_TRACE_DIR")
    trace_dir = Path(trace_raw).expanduser() if trace_raw else None
    if trace_dir is not None and not trace_dir.is_dir():
        problems.append(f"--trace-dir / DYNARL_TRACE_DIR: {str(trace_dir)!r} is not a directory")

    interval = _number(
        _pick(args.heartbeat_interval, environ, "DYNARL_HEARTBEAT_INTERVAL_S"),
        1.0,
        "--heartbeat-interval / DYNARL_HEARTBEAT_INTERVAL_S",
        problems,
        low=0.0,
    )
    poll_wait = _number(
        _pick(args.poll_wait, environ, "DYNARL_POLL_WAIT_S"),
        25.0,
        "--poll-wait / DYNARL_POLL_WAIT_S",
        problems,
        low=0.0,
        allow_low=True,
    )
    grace = _number(
        _pick(args.shutdown_grace, environ, "DYNARL_SHUTDOWN_GRACE_S"),
        30.0,
        "--shutdown-grace / DYNARL_SHUTDOWN_GRACE_S",
        problems,
        low=0.0,
        allow_low=True,
    )
    retry_max = _number(
        _pick(args.retry_max, environ, "DYNARL_RETRY_MAX_S"),
        30.0,
        "--retry-max / DYNARL_RETRY_MAX_S",
        problems,
        low=0.0,
    )
    buffered = _number(
        _pick(args.max_buffered_samples, environ, "DYNARL_MAX_BUFFERED_SAMPLES"),
        100_000,
        "--max-buffered-samples / DYNARL_MAX_BUFFERED_SAMPLES",
        problems,
        low=1,
        allow_low=True,
    )
    if buffered != int(buffered):
        problems.append("--max-buffered-samples / DYNARL_MAX_BUFFERED_SAMPLES: must be a whole number")

    nvml_env = environ.get("DYNARL_NVML", "1").strip().lower()
    if nvml_env not in ("0", "1", "true", "false", "yes", "no"):
        problems.append("DYNARL_NVML: must be 1 or 0")
    nvml = not args.no_nvml and nvml_env in ("1", "true", "yes")

    log_level = (_pick(args.log_level, environ, "DYNARL_LOG_LEVEL") or "INFO").upper()
    if log_level not in LOG_LEVELS:
        problems.append(f"--log-level / DYNARL_LOG_LEVEL: must be one of {', '.join(LOG_LEVELS)}")

    faults: tuple[Fault, ...] = ()
    try:
        faults = parse_faults(_pick(args.faults, environ, AGENT_FAULTS_ENV) or "")
    except FaultSpecError as exc:
        problems.append(f"--faults / {AGENT_FAULTS_ENV}: {exc}")
    faults_file_text = _pick(args.faults_file, environ, AGENT_FAULTS_FILE_ENV)
    faults_file = Path(faults_file_text).expanduser() if faults_file_text else None
    if faults_file is not None:
        try:
            read_fault_file(faults_file)
        except FAULT_FILE_ERRORS as exc:
            problems.append(f"--faults-file / {AGENT_FAULTS_FILE_ENV}: {faults_file}: {exc}")

    if problems:
        raise ConfigError(problems)
    return AgentConfig(
        url=url,
        bootstrap_token=token,
        backend=backend,
        host=host,
        state_dir=state_dir,
        backend_options=backend_options,
        labels=labels,
        heartbeat_interval_s=interval,
        poll_wait_s=poll_wait,
        shutdown_grace_s=grace,
        retry_max_s=retry_max,
        max_buffered_samples=int(buffered),
        nvml=nvml,
        log_level=log_level,
        trace_dir=trace_dir,
        faults=faults,
        faults_file=faults_file,
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
