"""Megatron GPTModel parameters <-> the rollout engine's parameter names.

The engine runs a plain-torch forward over these names (the contract both sides keep)::

    tok_emb.weight [V, H]            pos_emb.weight [P, H]
    layers.{i}.ln1.{weight,bias}     layers.{i}.attn.qkv.weight [3H, H], .bias [3H]
    layers.{i}.attn.proj.{weight,bias}
    layers.{i}.ln2.{weight,bias}     layers.{i}.mlp.fc1.{weight,bias}   layers.{i}.mlp.fc2.{weight,bias}
    ln_f.{weight,bias}               lm_head.weight [V, H]

The engine's fused QKV is [all q rows; all k rows; all v rows] with heads contiguous inside each
block (head h = rows h*d..(h+1)*d). megatron interleaves per query group instead: for
multi-head attention each head's [q_h; k_h; v_h] rows sit together. The conversion reorders
those rows and renames everything else; nothing is approximated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from runtime.model.config import GPTConfig

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Per-layer megatron suffix -> engine suffix. The local spec keeps separate LayerNorm modules;
# specs that fuse them into the next linear name them linear_*.layer_norm_*, mapped the same.
_LAYER_RENAMES = {
    "input_layernorm.weight": "ln1.weight",
    "input_layernorm.bias": "ln1.bias",
    "self_attention.linear_qkv.layer_norm_weight": "ln1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "ln1.bias",
    "self_attention.linear_qkv.weight": "attn.qkv.weight",
    "self_attention.linear_qkv.bias": "attn.qkv.bias",
    "self_attention.linear_proj.weight": "attn.proj.weight",
    "self_attention.linear_proj.bias": "attn.proj.bias",
    "pre_mlp_layernorm.weight": "ln2.weight",
    "pre_mlp_layernorm.bias": "ln2.bias",
    "mlp.linear_fc1.layer_norm_weight": "ln2.weight",
    "mlp.linear_fc1.layer_norm_bias": "ln2.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight",
    "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight",
    "mlp.linear_fc2.bias": "mlp.fc2.bias",
}
_GLOBAL_RENAMES = {
    "embedding.word_embeddings.weight": "tok_emb.weight",
    "embedding.position_embeddings.weight": "pos_emb.weight",
    "decoder.final_layernorm.weight": "ln_f.weight",
    "decoder.final_layernorm.bias": "ln_f.bias",
    "output_layer.weight": "lm_head.weight",
}
# The local spec's (unfused) names, used when converting back to megatron.
_ENGINE_TO_MEGATRON_LAYER = {
    engine: megatron for megatron, engine in _LAYER_RENAMES.items() if "layer_norm_" not in megatron
}
_ENGINE_TO_MEGATRON_GLOBAL = {engine: megatron for megatron, engine in _GLOBAL_RENAMES.items()}


class WeightConversionError(ValueError):
    """A state dict did not have the parameters the conversion expects."""


def engine_parameter_names(config: GPTConfig) -> list[str]:
    """Every name the engine expects, in a stable order."""
    names = ["tok_emb.weight", "pos_emb.weight"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{suffix}" for suffix in _ENGINE_TO_MEGATRON_LAYER]
    return [*names, "ln_f.weight", "ln_f.bias", "lm_head.weight"]


def _qkv_megatron_to_engine(tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    # [heads, (q, k, v), head_dim, ...] -> [(q, k, v), heads, head_dim, ...]
    rest = tensor.shape[1:]
    grouped = tensor.reshape(config.num_heads, 3, config.head_dim, *rest)
    return grouped.transpose(0, 1).reshape(3 * config.hidden_size, *rest)


def _qkv_engine_to_megatron(tensor: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    rest = tensor.shape[1:]
    blocks = tensor.reshape(3, config.num_heads, config.head_dim, *rest)
    return blocks.transpose(0, 1).reshape(3 * config.hidden_size, *rest)


def megatron_to_engine(state_dict: Mapping[str, object], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The engine's parameters from a megatron GPTModel state dict, as detached contiguous copies.

    megatron's `_extra_state` entries (Transformer Engine bookkeeping, None here) are skipped;
    any other unknown or missing parameter is an error rather than a silently wrong model.
    """
    converted: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if name.endswith("._extra_state"):
            continue
        if not isinstance(value, torch.Tensor):
            raise WeightConversionError(f"{name} is not a tensor")
        layer_match = _LAYER_KEY.match(name)
        if layer_match:
            suffix = _LAYER_RENAMES.get(layer_match.group(2))
            target = f"layers.{layer_match.group(1)}.{suffix}" if suffix else None
        else:
            target = _GLOBAL_RENAMES.get(name)
        if target is None:
            raise WeightConversionError(f"no engine name for megatron parameter {name}")
        tensor = value.detach()
        if target.endswith("attn.qkv.weight") or target.endswith("attn.qkv.bias"):
            tensor = _qkv_megatron_to_engine(tensor, config)
        converted[target] = tensor.clone().contiguous()
    missing = set(engine_parameter_names(config)) - set(converted)
    if missing:
        raise WeightConversionError(f"megatron state dict lacks parameters for {sorted(missing)}")
    return converted


def engine_to_megatron(weights: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The inverse: a state dict for the local-spec GPTModel (load it with strict=False, since
    megatron also lists `_extra_state` entries that carry nothing here)."""
    expected = engine_parameter_names(config)
    missing = set(expected) - set(weights)
    unknown = set(weights) - set(expected)
    if missing or unknown:
        raise WeightConversionError(f"engine weights: missing {sorted(missing)}, unknown {sorted(unknown)}")
    converted: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        tensor = value.detach()
        if name.startswith("layers."):
            _, index, suffix = name.split(".", 2)
            target = f"decoder.layers.{index}.{_ENGINE_TO_MEGATRON_LAYER[suffix]}"
            if suffix in ("attn.qkv.weight", "attn.qkv.bias"):
                tensor = _qkv_engine_to_megatron(tensor, config)
        else:
            target = _ENGINE_TO_MEGATRON_GLOBAL[name]
        converted[target] = tensor.clone().contiguous()
    return converted
