"""Which backend carries the trainer's weights to the engines: NCCL only between a CUDA trainer and
GPU servers; gloo wherever one end is on the host (a CPU trainer, or the CPU stand-in engine, which
names itself in /server_info)."""

from __future__ import annotations

import torch

from runtime.engine.cpu_server import ENGINE_NAME
from runtime.rl.weight_push import weight_update_backend

SGLANG = {"version": "0.5.2", "model_path": "/models/qwen"}  # SGLang's /server_info names no engine
CPU_STAND_IN = {"engine": ENGINE_NAME, "version": f"{ENGINE_NAME} (SGLang 0.5 protocol)"}


def test_a_cuda_trainer_and_sglang_servers_use_nccl() -> None:
    assert weight_update_backend(torch.device("cuda", 0), [SGLANG, SGLANG]) == "nccl"


def test_gloo_wherever_one_end_is_on_the_host() -> None:
    assert weight_update_backend(torch.device("cpu"), [SGLANG]) == "gloo"
    assert weight_update_backend(torch.device("cuda", 0), [SGLANG, CPU_STAND_IN]) == "gloo"
    assert weight_update_backend(torch.device("cpu"), [CPU_STAND_IN]) == "gloo"
