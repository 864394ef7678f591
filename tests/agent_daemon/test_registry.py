"""Backends by name: options become keyword arguments, the host goes to those that take it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from agents.daemon.registry import BACKENDS, BackendError, load_backend, offered_backends
from tests.agent_daemon.recording import RecordingBackend


def test_a_backend_is_built_from_module_and_callable(tmp_path: Path) -> None:
    backend = load_backend(
        "tests.agent_daemon.recording:RecordingBackend",
        host="gpu-3",
        options={"record": str(tmp_path / "calls.jsonl"), "gpus": 2},
    )
    assert isinstance(backend, RecordingBackend)
    assert backend.host == "gpu-3" and [d.index for d in backend.inventory()] == [0, 1]


def test_known_names_point_at_the_backend_modules() -> None:
    assert BACKENDS["sim"] == "agents.backends.sim.backend:SimBackend"
    assert BACKENDS["ray"] == "agents.backends.ray.backend:RayBackend"


def test_a_ray_backend_whose_cluster_cannot_be_reached_is_a_clear_error_at_once() -> None:
    """Not a hang: the agent exits with the address it tried (nothing listens on port 1)."""
    if ray.is_initialized():
        ray.shutdown()  # an agent joins its cluster once; this process may have joined the tests' one
    started = time.monotonic()
    with pytest.raises(
        BackendError, match=r"backend 'ray' cannot start: cannot reach the Ray cluster at 127\.0\.0\.1:1"
    ):
        load_backend("ray", host="gpu-3", options={"address": "127.0.0.1:1", "connect_timeout_s": 2})
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("nonsense", {}, "neither a known backend"),
        ("agents.backends.nowhere:Backend", {}, "cannot import backend module"),
        ("agents.backends.base:Nothing", {}, "has no callable"),
        (
            "tests.agent_daemon.recording:RecordingBackend",
            {"record": "x", "colour": "red"},
            "refused its options",
        ),
        ("agents.backends.base:Telemetry", {}, "lacks"),
    ],
)
def test_a_backend_that_cannot_be_built_is_named(name: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(BackendError, match=message):
        load_backend(name, host="gpu-3", options=options)


class _OffersRay(RecordingBackend):
    offers = ("ray",)


class _OffersNothing(RecordingBackend):
    offers = ()


def test_a_backend_offers_its_name_unless_it_names_what_it_offers(tmp_path: Path) -> None:
    sim = load_backend("sim", host="gpu-3", options={"gpus": 1})
    try:
        assert offered_backends(sim) == ("sim",)
    finally:
        sim.close()
    record = str(tmp_path / "calls.jsonl")
    assert offered_backends(RecordingBackend(host="gpu-3", record=record)) == ("sim",)
    assert offered_backends(_OffersRay(host="gpu-3", record=record)) == ("ray",)
    with pytest.raises(BackendError, match="offers must be a non-empty list"):
        offered_backends(_OffersNothing(host="gpu-3", record=record))
