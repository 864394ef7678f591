"""The supervised warm start a job's policy begins RL from, and its cache on disk.

Every job (and every test and benchmark of one) starts from the same weights for the same
`RLJobConfig`: a few hundred supervised steps on the task, computed once per configuration, device
kind and torch version, and kept as a checkpoint any engine loads (ours or SGLang).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from runtime.model.checkpoint import hf_to_engine, is_checkpoint, load_checkpoint, save_checkpoint
from runtime.model.megatron_gpt import build_gpt_model
from runtime.model.sft import supervised_warm_start
from runtime.model.weights import megatron_to_engine
from runtime.rl.job import RLJobConfig
from runtime.rl.trainer import training_device
from runtime.task.tokenizer import BOS_ID, EOS_ID, PAD_ID, CharTokenizer

# Bumped when warm_start_weights changes what it computes, so stale cache entries are not read.
_WARM_START_CACHE_FORMAT = 2


def warm_start_cache_key(config: RLJobConfig) -> str:
    """What the warm start's result depends on: model shape, SFT settings (with seed and task),
    the device kind and the torch version (initialisation and kernels differ across them)."""
    material = json.dumps(
        {
            "format": _WARM_START_CACHE_FORMAT,
            "model": asdict(config.model),
            "sft": asdict(config.sft_config()),
            "device": training_device().type,
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def warm_start_checkpoint(config: RLJobConfig, cache_dir: Path) -> Path:
    """Where the warm start's checkpoint (Hugging Face layout, see runtime/model/checkpoint.py)
    lives under ``cache_dir``: a directory named by `warm_start_cache_key`."""
    return Path(cache_dir) / f"warm-start-{warm_start_cache_key(config)}"


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """On one CPU thread: the order of a matmul's float sums depends on torch's thread count, so
    the same seed gives the same warm start in a driver (one thread), a benchmark or a test
    process only when they compute it alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def warm_start_weights(config: RLJobConfig, cache_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """The supervised warm start's weights in the engine's names (on the CPU), from the job's seed.

    With ``cache_dir`` the result is read from, or else written to, `warm_start_checkpoint`, a
    checkpoint any engine (ours or SGLang) loads; it is written atomically, so concurrent jobs
    never read half of one.
    """
    path = warm_start_checkpoint(config, cache_dir) if cache_dir is not None else None
    if path is not None and is_checkpoint(path):
        _, tensors = load_checkpoint(path)
        return hf_to_engine(tensors, config.model)
    with _one_thread():
        model = build_gpt_model(config.model, seed=config.seed)
        if config.warm_start_steps:
            supervised_warm_start(model, CharTokenizer(), config.sft_config())
    weights = {
        name: tensor.cpu() for name, tensor in megatron_to_engine(model.state_dict(), config.model).items()
    }
    if path is not None:
        save_checkpoint(
            path, weights, config.model, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
        )
    return weights
