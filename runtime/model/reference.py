"""A small, readable forward over the engine's parameter names (full sequence, no KV cache).

It states what the names in `runtime.model.weights` mean: token plus learned position
embeddings, pre-LayerNorm blocks (causal multi-head attention scaled by 1/sqrt(head_dim), then an
exact-erf GELU MLP), a final LayerNorm and an untied output head. Tests hold megatron's logits
to it after conversion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from runtime.model.config import GPTConfig


def _attention(
    x: torch.Tensor, weights: Mapping[str, torch.Tensor], prefix: str, config: GPTConfig
) -> torch.Tensor:
    batch, seq_len, hidden = x.shape
    qkv = F.linear(x, weights[f"{prefix}attn.qkv.weight"], weights[f"{prefix}attn.qkv.bias"])
    q, k, v = (
        part.view(batch, seq_len, config.num_heads, config.head_dim).transpose(1, 2)
        for part in qkv.chunk(3, dim=-1)
    )
    scores = q @ k.transpose(-2, -1) / math.sqrt(config.head_dim)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    context = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, seq_len, hidden)
    return F.linear(context, weights[f"{prefix}attn.proj.weight"], weights[f"{prefix}attn.proj.bias"])


def _mlp(x: torch.Tensor, weights: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    hidden = F.gelu(F.linear(x, weights[f"{prefix}mlp.fc1.weight"], weights[f"{prefix}mlp.fc1.bias"]))
    return F.linear(hidden, weights[f"{prefix}mlp.fc2.weight"], weights[f"{prefix}mlp.fc2.bias"])


def reference_logits(
    weights: Mapping[str, torch.Tensor], config: GPTConfig, token_ids: torch.Tensor
) -> torch.Tensor:
    """Logits [batch, seq, vocab] for token ids [batch, seq]."""
    seq_len = token_ids.shape[1]
    if seq_len > config.max_positions:
        raise ValueError(f"sequence of {seq_len} exceeds max_positions={config.max_positions}")
    eps = config.layernorm_epsilon
    shape = (config.hidden_size,)
    x = weights["tok_emb.weight"][token_ids] + weights["pos_emb.weight"][:seq_len]
    for i in range(config.num_layers):
        prefix = f"layers.{i}."
        normed = F.layer_norm(x, shape, weights[f"{prefix}ln1.weight"], weights[f"{prefix}ln1.bias"], eps)
        x = x + _attention(normed, weights, prefix, config)
        normed = F.layer_norm(x, shape, weights[f"{prefix}ln2.weight"], weights[f"{prefix}ln2.bias"], eps)
        x = x + _mlp(normed, weights, prefix)
    x = F.layer_norm(x, shape, weights["ln_f.weight"], weights["ln_f.bias"], eps)
    return F.linear(x, weights["lm_head.weight"])
