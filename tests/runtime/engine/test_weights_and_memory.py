"""Weight updates (from disk, from a gloo group), per-token weight versions, memory release/resume."""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine.client import EngineError, WeightUpdateResult
from runtime.engine.model import init_random_gpt
from runtime.engine.weight_sync import broadcast_from_trainer, create_weight_update_group, dtype_name
from runtime.model.checkpoint import WEIGHTS_FILE, engine_to_hf, save_checkpoint
from tests.runtime.engine.conftest import TINY, WAIT_S, Served, greedy_reference, make_model

PROMPT = [4, 8, 15, 16, 23, 4, 2]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0}


def save_weights(path: Path, seed: int) -> Path:
    """A checkpoint in the layout SGLang loads (config.json + model.safetensors)."""
    return save_checkpoint(
        path, make_model(seed).state_dict(), TINY, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )


def test_update_from_disk_reports_the_new_version_and_changes_the_outputs(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve()
    before = served.client.generate(PROMPT, GREEDY)
    assert before.output_ids == greedy_reference(make_model(0), PROMPT, 10)[0]
    result = served.client.update_weights_from_disk(str(save_weights(tmp_path / "step1", seed=1)), "step-1")
    assert result.success and "step-1" in result.message
    assert served.client.weight_version() == "step-1"
    after = served.client.generate(PROMPT, GREEDY)
    assert after.output_ids == greedy_reference(make_model(1), PROMPT, 10)[0] != before.output_ids
    assert after.weight_version == "step-1"
    # The prefix cache was flushed with the old weights: nothing of PROMPT was served from it.
    assert after.cached_tokens == 0


def test_a_refused_weight_update_names_the_route_and_keeps_the_weights(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve()
    with pytest.raises(EngineError, match=r"/update_weights_from_disk: HTTP 400: no checkpoint at"):
        served.client.update_weights_from_disk(str(tmp_path / "missing"), "never")
    wrong = save_weights(tmp_path / "wrong", seed=1)
    tensors = load_file(str(wrong / WEIGHTS_FILE))
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(wrong / WEIGHTS_FILE))
    with pytest.raises(EngineError, match=r"lm_head.weight: shape \[3, 3\]"):
        served.client.update_weights_from_disk(str(wrong), "never")
    other_shape = dataclasses.replace(TINY, max_positions=64)
    bigger = save_checkpoint(
        tmp_path / "other",
        init_random_gpt(other_shape, seed=1).state_dict(),
        other_shape,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with pytest.raises(EngineError, match=r"holds a model of another shape"):
        served.client.update_weights_from_disk(str(bigger), "never")
    assert served.client.weight_version() == "default"
    assert served.client.generate(PROMPT, GREEDY).output_ids == greedy_reference(make_model(0), PROMPT, 10)[0]


def test_tokens_record_the_weight_version_they_were_generated_under(
    serve: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve()
    served.client.slow_down(0.01)
    weights = save_weights(tmp_path / "step2", seed=2)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            served.client.generate, PROMPT, {"max_new_tokens": 30, "temperature": 0.0}, "spans."
        )
        served.wait_tokens("spans.", 5)
        served.client.update_weights_from_disk(str(weights), "step-2")
        result = future.result(WAIT_S)
    versions = result.token_weight_versions()
    switch = versions.index("step-2")
    assert switch >= 5 and set(versions[:switch]) == {"default"} and set(versions[switch:]) == {"step-2"}
    assert result.weight_versions == [
        {"version": "default", "start": 0, "end": switch},
        {"version": "step-2", "start": switch, "end": 30},
    ]
    assert result.weight_version == "step-2"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_update_from_a_gloo_group_where_this_process_is_the_trainer(serve: Callable[..., Served]) -> None:
    served = serve()
    port = free_port()
    joined: list[WeightUpdateResult] = []
    engine_side = threading.Thread(
        target=lambda: joined.append(
            served.client.init_weights_update_group("127.0.0.1", port, 1, 2, "push", "gloo")
        )
    )
    engine_side.start()
    group = create_weight_update_group(
        "127.0.0.1", port, rank=0, world_size=2, group_name="push", timeout_s=WAIT_S
    )
    engine_side.join(WAIT_S)
    assert joined and joined[0].success

    # The names on the wire are the checkpoint's, as for SGLang.
    new_weights = engine_to_hf(make_model(3).state_dict())
    names = list(new_weights)
    with ThreadPoolExecutor(1) as pool:
        update = pool.submit(
            served.client.update_weights_from_distributed,
            names,
            [dtype_name(new_weights[name].dtype) for name in names],
            [list(new_weights[name].shape) for name in names],
            "push",
            "step-3",
        )
        broadcast_from_trainer(group, [new_weights[name] for name in names])
        assert update.result(WAIT_S).success
    assert served.client.weight_version() == "step-3"
    assert served.client.generate(PROMPT, GREEDY).output_ids == greedy_reference(make_model(3), PROMPT, 10)[0]
    with pytest.raises(
        EngineError, match=r"/update_weights_from_distributed: HTTP 400: no weight update group"
    ):
        served.client.update_weights_from_distributed(["ln_f.bias"], ["float32"], [[32]], group_name="absent")
    assert served.client.destroy_weights_update_group("push").success


def test_memory_release_refuses_generation_until_resumed_with_the_same_weights(
    serve: Callable[..., Served],
) -> None:
    served = serve()
    before = served.client.generate(PROMPT, GREEDY).output_ids
    served.client.release_memory_occupation()
    assert served.engine.state()["released"] == ["kv_cache", "weights"]
    assert all(parameter.numel() == 0 for parameter in served.engine.model.parameters())
    with pytest.raises(EngineError, match=r"/generate: HTTP 400: .*memory is released"):
        served.client.generate(PROMPT, GREEDY)
    served.client.resume_memory_occupation(["kv_cache"])
    with pytest.raises(EngineError, match=r"released \(weights\)"):
        served.client.generate(PROMPT, GREEDY)
    served.client.resume_memory_occupation(["weights"])
    assert served.client.generate(PROMPT, GREEDY).output_ids == before


def test_memory_release_is_refused_while_requests_are_in_flight(serve: Callable[..., Served]) -> None:
    served = serve()
    served.client.slow_down(0.01)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            served.client.generate, PROMPT, {"max_new_tokens": 200, "temperature": 0.0}, "busy."
        )
        served.wait_tokens("busy.", 1)
        with pytest.raises(EngineError, match=r"/release_memory_occupation: HTTP 400: .*in flight"):
            served.client.release_memory_occupation()
        served.client.abort_request("busy.")
        assert future.result(WAIT_S).aborted
    served.client.release_memory_occupation(["kv_cache"])
    served.client.resume_memory_occupation(["kv_cache"])
    assert served.client.generate(PROMPT, GREEDY).completion_tokens == 10
