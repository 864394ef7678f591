"""The real-SGLang launcher: what it starts, and how its absence is reported rather than hidden.

This machine has neither SGLang nor CUDA, so these tests hold the launcher to what it does here:
the CPU stand-in is chosen with the reason, a job that insists on SGLang is refused with it, and
a server that exits before serving is an error carrying its log. The command line is checked
against the flags SGLang's ``launch_server`` defines.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from runtime.engine.sglang_server import (
    SGLangServer,
    SGLangUnavailable,
    _counter,
    choose_engine,
    unavailable_reason,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None and torch.cuda.is_available(),
    reason="SGLang runs here: these tests are about a host where it cannot",
)


def test_auto_falls_back_to_the_cpu_stand_in_and_says_why() -> None:
    reason = unavailable_reason()
    assert reason is not None
    assert choose_engine("auto") == ("cpu", f"CPU stand-in for SGLang: {reason}")
    assert choose_engine("cpu") == ("cpu", "")


def test_a_job_that_insists_on_sglang_is_refused_with_the_reason() -> None:
    with pytest.raises(
        SGLangUnavailable, match=r"the job asks for SGLang engines, but (SGLang is not installed|no CUDA)"
    ):
        choose_engine("sglang")
    with pytest.raises(ValueError, match="engine must be one of auto, sglang, cpu"):
        choose_engine("vllm")


def test_the_server_command_serves_our_checkpoint_with_token_ids_only(tmp_path: Path) -> None:
    server = SGLangServer(tmp_path / "model", host="10.0.0.5", port=30001, max_running_requests=16, seed=7)
    command = server.command()
    assert command[1:3] == ["-m", "sglang.launch_server"]
    arguments = command[3:]
    flags = {
        flag: (value if not value.startswith("--") else "")
        for flag, value in zip(arguments, [*arguments[1:], "--"], strict=True)
        if flag.startswith("--")
    }
    assert flags["--model-path"] == str(tmp_path / "model")
    assert (flags["--host"], flags["--port"], flags["--tp-size"]) == ("10.0.0.5", "30001", "1")
    assert flags["--max-running-requests"] == "16" and flags["--random-seed"] == "7"
    assert {"--skip-tokenizer-init", "--enable-memory-saver", "--enable-metrics"} <= set(command)
    assert server.url == "http://10.0.0.5:30001"


def test_a_server_that_exits_before_serving_is_an_error_with_its_log(tmp_path: Path) -> None:
    server = SGLangServer(tmp_path / "model", host="127.0.0.1", port=1)
    with pytest.raises(SGLangUnavailable, match=r"SGLang exited with status 1 before serving: .*sglang"):
        server.start(timeout_s=60)
    server.stop()


def test_prometheus_counters_sum_over_their_label_sets() -> None:
    text = "\n".join(
        [
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
            "# TYPE sglang:generation_tokens_total counter",
            'sglang:generation_tokens_total{model_name="m",engine_type="unified"} 120.0',
            'sglang:generation_tokens_total{model_name="m",engine_type="other"} 5.0',
            "sglang:generation_tokens_total_created 1.7e9",
            'sglang:num_requests_total{model_name="m"} 3.0',
        ]
    )
    assert _counter(text, "sglang:generation_tokens_total") == 125.0
    assert _counter(text, "sglang:num_requests_total") == 3.0
    assert _counter(text, "sglang:absent") == 0.0
