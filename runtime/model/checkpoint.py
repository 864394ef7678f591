"""Checkpoints in the Hugging Face layout that SGLang loads: ``config.json`` + ``model.safetensors``.

Our model is, parameter for parameter, an OPT decoder (``OPTForCausalLM``): pre-LayerNorm
blocks, learned absolute positions, an exact-erf GELU MLP, biases everywhere and an untied output
head. OPT is the architecture SGLang (and transformers) implement with exactly those choices —
GPT-2 and GPTBigCode tie the head and GPT-2 hard-codes the tanh GELU — so a checkpoint written
here is what ``python -m sglang.launch_server --model-path DIR`` and SGLang's
``/update_weights_from_disk`` read, and the names in it are the names the trainer sends through
``/update_weights_from_distributed``. The CPU engine reads the same files and names.

Two details of OPT's layout:

- the position table has two extra leading rows (OPT looks position ``p`` up at row ``p + 2``;
  written as zeros, never read);
- q, k and v are separate projections; the engine fuses them as ``[q rows; k rows; v rows]``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from runtime.model.config import GPTConfig

ARCHITECTURE = "OPTForCausalLM"
MODEL_TYPE = "opt"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# OPT looks position p up at row p + 2 of its table.
POSITION_OFFSET = 2

_PREFIX = "model.decoder."
_LAYER = re.compile(r"^model\.decoder\.layers\.(\d+)\.(.+)$")
# Per-layer checkpoint suffix -> (engine suffix, which third of the fused qkv; None: all of it).
_LAYER_NAMES: dict[str, tuple[str, int | None]] = {
    "self_attn_layer_norm.weight": ("ln1.weight", None),
    "self_attn_layer_norm.bias": ("ln1.bias", None),
    "self_attn.q_proj.weight": ("attn.qkv.weight", 0),
    "self_attn.q_proj.bias": ("attn.qkv.bias", 0),
    "self_attn.k_proj.weight": ("attn.qkv.weight", 1),
    "self_attn.k_proj.bias": ("attn.qkv.bias", 1),
    "self_attn.v_proj.weight": ("attn.qkv.weight", 2),
    "self_attn.v_proj.bias": ("attn.qkv.bias", 2),
    "self_attn.out_proj.weight": ("attn.proj.weight", None),
    "self_attn.out_proj.bias": ("attn.proj.bias", None),
    "final_layer_norm.weight": ("ln2.weight", None),
    "final_layer_norm.bias": ("ln2.bias", None),
    "fc1.weight": ("mlp.fc1.weight", None),
    "fc1.bias": ("mlp.fc1.bias", None),
    "fc2.weight": ("mlp.fc2.weight", None),
    "fc2.bias": ("mlp.fc2.bias", None),
}
_GLOBAL_NAMES = {
    _PREFIX + "embed_tokens.weight": "tok_emb.weight",
    _PREFIX + "final_layer_norm.weight": "ln_f.weight",
    _PREFIX + "final_layer_norm.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}
_POSITIONS = _PREFIX + "embed_positions.weight"


class CheckpointError(ValueError):
    """A checkpoint, or a set of named weights, does not fit the model."""


@dataclass(frozen=True)
class EngineSlice:
    """Where one checkpoint tensor goes in the engine's parameters: rows ``start:stop`` of
    ``name`` (the whole parameter when ``start`` is None)."""

    name: str
    tensor: torch.Tensor
    start: int | None = None
    stop: int | None = None


def hf_config(
    config: GPTConfig, *, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> dict[str, Any]:
    """``config.json`` for ``config``: the fields transformers' OPTConfig and SGLang read."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "word_embed_proj_dim": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "ffn_dim": config.ffn_hidden_size,
        "max_position_embeddings": config.max_positions,
        "activation_function": "gelu",
        "do_layer_norm_before": True,
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": False,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": "float32",
    }


def gpt_config_from_hf(data: Mapping[str, Any]) -> GPTConfig:
    """The model shape a ``config.json`` describes; anything but our OPT variant is refused."""
    if data.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"model_type is {data.get('model_type')!r}, expected {MODEL_TYPE!r}")
    required = {
        "activation_function": "gelu",
        "do_layer_norm_before": True,
        "enable_bias": True,
        "tie_word_embeddings": False,
    }
    for field, value in required.items():
        if data.get(field, value) != value:
            raise CheckpointError(f"{field} is {data.get(field)!r}; this model needs {value!r}")
    if data.get("word_embed_proj_dim", data.get("hidden_size")) != data.get("hidden_size"):
        raise CheckpointError("word_embed_proj_dim must equal hidden_size")
    try:
        return GPTConfig(
            vocab_size=int(data["vocab_size"]),
            hidden_size=int(data["hidden_size"]),
            num_layers=int(data["num_hidden_layers"]),
            num_heads=int(data["num_attention_heads"]),
            ffn_hidden_size=int(data["ffn_dim"]),
            max_positions=int(data["max_position_embeddings"]),
        )
    except KeyError as error:
        raise CheckpointError(f"config.json lacks {error.args[0]}") from error


def engine_to_hf(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors from the engine's (every parameter, see weights.py), as copies."""
    converted: dict[str, torch.Tensor] = {}
    engine_to_global = {engine: name for name, engine in _GLOBAL_NAMES.items()}
    for name, tensor in weights.items():
        value = tensor.detach()
        if name in engine_to_global:
            converted[engine_to_global[name]] = value.clone().contiguous()
        elif name == "pos_emb.weight":
            padding = value.new_zeros(POSITION_OFFSET, *value.shape[1:])
            converted[_POSITIONS] = torch.cat([padding, value]).contiguous()
        elif name.startswith("layers."):
            _, index, suffix = name.split(".", 2)
            parts = [(ckpt, third) for ckpt, (engine, third) in _LAYER_NAMES.items() if engine == suffix]
            if not parts:
                raise CheckpointError(f"no checkpoint name for engine parameter {name}")
            thirds = value.chunk(3) if parts[0][1] is not None else None
            for checkpoint_suffix, third in parts:
                part = value if thirds is None or third is None else thirds[third]
                converted[f"{_PREFIX}layers.{index}.{checkpoint_suffix}"] = part.clone().contiguous()
        else:
            raise CheckpointError(f"no checkpoint name for engine parameter {name}")
    return converted


def hf_to_engine_slices(weights: Mapping[str, torch.Tensor], config: GPTConfig) -> list[EngineSlice]:
    """Where each checkpoint tensor (any subset, e.g. one pushed update) lands in the engine.

    Names are checked; shapes are the caller's to check against its parameters.
    """
    hidden = config.hidden_size
    slices: list[EngineSlice] = []
    for name, tensor in weights.items():
        if name in _GLOBAL_NAMES:
            slices.append(EngineSlice(_GLOBAL_NAMES[name], tensor))
            continue
        if name == _POSITIONS:
            if tensor.ndim != 2 or tensor.shape[0] != config.max_positions + POSITION_OFFSET:
                raise CheckpointError(
                    f"{name}: shape {list(tensor.shape)}, expected "
                    f"[{config.max_positions + POSITION_OFFSET}, {hidden}]"
                )
            slices.append(EngineSlice("pos_emb.weight", tensor[POSITION_OFFSET:]))
            continue
        match = _LAYER.match(name)
        mapped = _LAYER_NAMES.get(match.group(2)) if match else None
        if match is None or mapped is None or int(match.group(1)) >= config.num_layers:
            raise CheckpointError(f"{name}: unknown parameter")
        suffix, third = mapped
        target = f"layers.{match.group(1)}.{suffix}"
        if third is None:
            slices.append(EngineSlice(target, tensor))
        else:
            slices.append(EngineSlice(target, tensor, third * hidden, (third + 1) * hidden))
    return slices


def hf_to_engine(weights: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The engine's parameters from a complete checkpoint's tensors (the inverse of
    `engine_to_hf`)."""
    missing = sorted(set(checkpoint_names(config)) - set(weights))
    if missing:
        raise CheckpointError(f"the checkpoint lacks parameters: {', '.join(missing[:5])}")
    whole: dict[str, torch.Tensor] = {}
    thirds: dict[str, list[torch.Tensor | None]] = {}
    for part in hf_to_engine_slices(weights, config):
        if part.start is None:
            whole[part.name] = part.tensor.clone().contiguous()
        else:
            thirds.setdefault(part.name, [None, None, None])[part.start // config.hidden_size] = part.tensor
    for name, parts in thirds.items():
        whole[name] = torch.cat([part for part in parts if part is not None]).contiguous()
    return whole


def checkpoint_names(config: GPTConfig) -> list[str]:
    """Every tensor a complete checkpoint of ``config`` holds."""
    names = [_PREFIX + "embed_tokens.weight", _POSITIONS]
    for i in range(config.num_layers):
        names += [f"{_PREFIX}layers.{i}.{suffix}" for suffix in _LAYER_NAMES]
    return [*names, _PREFIX + "final_layer_norm.weight", _PREFIX + "final_layer_norm.bias", "lm_head.weight"]


def save_checkpoint(
    directory: Path, weights: Mapping[str, torch.Tensor], config: GPTConfig, **token_ids: int
) -> Path:
    """Write ``weights`` (the engine's names) as a checkpoint directory, atomically: it is built
    beside ``directory`` and renamed into place, so a reader never sees half of one.
    ``token_ids`` are ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".", suffix=".tmp", dir=directory.parent))
    try:
        (staging / CONFIG_FILE).write_text(
            json.dumps(hf_config(config, **token_ids), indent=2, sort_keys=True) + "\n"
        )
        save_file(engine_to_hf(weights), str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        try:
            os.replace(staging, directory)
        except OSError:
            if not is_checkpoint(directory):  # another writer won the race with the same content
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def is_checkpoint(directory: Path) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file() and (Path(directory) / WEIGHTS_FILE).is_file()


def load_checkpoint(directory: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """A checkpoint directory's model shape and tensors (checkpoint names, on the CPU)."""
    directory = Path(directory)
    if not is_checkpoint(directory):
        raise CheckpointError(
            f"no checkpoint at {str(directory)!r} (a directory with {CONFIG_FILE} and {WEIGHTS_FILE})"
        )
    try:
        data = json.loads((directory / CONFIG_FILE).read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{directory / CONFIG_FILE} is not JSON: {error}") from error
    config = gpt_config_from_hf(data)
    tensors = load_file(str(directory / WEIGHTS_FILE), device="cpu")
    missing = sorted(set(checkpoint_names(config)) - set(tensors))
    if missing:
        raise CheckpointError(f"{directory} lacks parameters: {', '.join(missing[:5])}")
    return config, tensors
