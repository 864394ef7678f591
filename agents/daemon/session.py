"""The agent's standing with the control plane: registration and the node token.

Registration exchanges the bootstrap token for a node token (rotated at every registration) and
returns the workers this node should run and the protocol settings. Requests made with the node
token go through :meth:`AgentSession.call`: a 401 means the token was rotated or revoked, so the
agent registers again with the bootstrap token and repeats the request once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from agents.backends.base import DeviceInfo
from agents.daemon.client import (
    PROTOCOL_VERSION,
    ApiError,
    Backoff,
    ControlPlaneClient,
    retrying,
)
from agents.daemon.config import AgentConfig
from agents.daemon.state import StateDir

log = logging.getLogger(__name__)
# Registration also admits waiting jobs onto the node's devices: give it longer than a heartbeat.
REGISTER_TIMEOUT_S = 30.0


def agent_version() -> str:
    try:
        return metadata.version("dynarl")[:32]
    except metadata.PackageNotFoundError:
        return ""


class RegistrationRefused(RuntimeError):
    """The control plane will not register this agent (bad bootstrap token, invalid inventory)."""


@dataclass(frozen=True)
class ProtocolSettings:
    """What the control plane tells agents at registration (its values win over the agent's)."""

    heartbeat_interval_s: float
    long_poll_max_wait_s: float
    lost_after_s: float

    @classmethod
    def from_reply(cls, settings: Any, fallback_interval_s: float) -> ProtocolSettings:
        data = settings if isinstance(settings, Mapping) else {}

        def number(key: str, default: float) -> float:
            value = data.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                return float(value)
            return default

        return cls(
            heartbeat_interval_s=number("heartbeat_interval_s", fallback_interval_s),
            long_poll_max_wait_s=number("long_poll_max_wait_s", 60.0),
            lost_after_s=number("lost_after_s", 30.0),
        )


@dataclass(frozen=True)
class Registration:
    token: str
    created: bool
    workers: list[dict[str, Any]]  # the workers this node should run (starting or running)
    jobs: dict[str, Any]  # job id (a string) -> its spec, for every job in ``workers``
    settings: ProtocolSettings


class AgentSession:
    """The node token and how to get a new one. Thread-safe: the heartbeat and command threads
    share it, and two 401s at once lead to one registration."""

    def __init__(
        self,
        config: AgentConfig,
        client: ControlPlaneClient,
        state: StateDir,
        inventory: Sequence[DeviceInfo],
        backend_name: str,
        backoff: Backoff,
        stop: threading.Event,
        backends: Sequence[str] = (),
        steps_outlive_agent: bool = False,
    ) -> None:
        self.config = config
        self.client = client
        self.state = state
        self.inventory = list(inventory)
        self.backend_name = backend_name
        self.backends = list(backends) or [backend_name]  # the job backends this agent runs
        self.steps_outlive_agent = steps_outlive_agent
        self.backoff = backoff
        self.stop = stop
        self.settings = ProtocolSettings.from_reply({}, config.heartbeat_interval_s)
        self._lock = threading.Lock()
        self._token = state.read_token(config.url, config.host)

    @property
    def token(self) -> str:
        with self._lock:
            return self._token

    def registration_body(self) -> dict[str, Any]:
        return {
            "host": self.config.host,
            "backend": self.backend_name,
            "backends": list(self.backends),
            "agent_version": agent_version(),
            "steps_outlive_agent": self.steps_outlive_agent,
            "labels": dict(self.config.labels),
            "devices": [device.to_json() for device in self.inventory],
        }

    def _register_once(self) -> Registration:
        if not self.config.bootstrap_token:
            raise RegistrationRefused(
                "no bootstrap token configured (--bootstrap-token / DYNARL_BOOTSTRAP_TOKEN)"
            )
        try:
            reply = retrying(
                lambda: self.client.request(
                    "POST",
                    "/api/v1/agent/register",
                    body=self.registration_body(),
                    token=self.config.bootstrap_token,
                    timeout_s=REGISTER_TIMEOUT_S,
                ),
                backoff=self.backoff,
                describe="register",
                give_up=self.stop,
            )
        except ApiError as exc:
            raise RegistrationRefused(str(exc)) from exc
        if not isinstance(reply, Mapping) or not isinstance(reply.get("token"), str):
            raise RegistrationRefused(f"the control plane's registration reply has no token: {reply!r}")
        if reply.get("protocol") != PROTOCOL_VERSION:
            raise RegistrationRefused(
                f"the control plane speaks agent protocol {reply.get('protocol')!r}; "
                f"this agent speaks {PROTOCOL_VERSION}"
            )
        workers = [w for w in reply.get("workers", []) if isinstance(w, dict)]
        jobs = reply.get("jobs", {})
        registration = Registration(
            token=reply["token"],
            created=bool(reply.get("created")),
            workers=workers,
            jobs=dict(jobs) if isinstance(jobs, Mapping) else {},
            settings=ProtocolSettings.from_reply(reply.get("settings"), self.config.heartbeat_interval_s),
        )
        self.state.write_token(self.config.url, self.config.host, registration.token)
        self.settings = registration.settings
        self._token = registration.token
        log.info(
            "%s as %s with %d devices; %d workers expected here; heartbeat every %.2fs",
            "registered" if registration.created else "registered again",
            self.config.host,
            len(self.inventory),
            len(workers),
            registration.settings.heartbeat_interval_s,
        )
        return registration

    def register(self) -> Registration:
        """Register (or again, rotating the token); retries until the control plane answers.
        Raises RegistrationRefused on a 4xx, GaveUp when the agent is stopping."""
        with self._lock:
            return self._register_once()

    def _reregister_after_401(self, rejected: str) -> None:
        # No reconciliation here: the node itself is unchanged (same workers, same devices), and
        # reconciling while commands are in hand could stop workers a step is starting.
        with self._lock:
            if self._token != rejected:
                return  # another thread registered already; its token is the one to use
            log.warning("the control plane refused the node token; registering again")
            self._register_once()

    def call(self, method: str, path: str, *, body: Any = None, timeout_s: float | None = None) -> Any:
        """One request with the node token; on 401, register again and repeat it once."""
        token = self.token
        try:
            return self.client.request(method, path, body=body, token=token, timeout_s=timeout_s)
        except ApiError as exc:
            if exc.status != 401:
                raise
        self._reregister_after_401(token)
        return self.client.request(method, path, body=body, token=self.token, timeout_s=timeout_s)
