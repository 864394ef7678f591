"""The policy as a megatron-core GPTModel: build it, run it to logits, score tokens.

Local layer spec (no Transformer Engine), TP=1, PP=1, learned absolute positions, an untied
output head, LayerNorm, exact GELU, biases on every linear and no dropout. On a CPU host the
weights are initialised on the CPU in float32 and megatron runs through `megatron_compat`; with
CUDA the same model is built on the current device by megatron's normal path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.config import GPTConfig
from runtime.model.megatron_compat import cpu_shims_active, initialize_megatron, quiet_megatron

with quiet_megatron():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig


def transformer_config(config: GPTConfig) -> TransformerConfig:
    """megatron's TransformerConfig for our GPTConfig (fusions off: they need CUDA kernels)."""
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads,
        ffn_hidden_size=config.ffn_hidden_size,
        layernorm_epsilon=config.layernorm_epsilon,
        normalization="LayerNorm",
        activation_func=F.gelu,
        add_bias_linear=True,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=cpu_shims_active(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        # The same as megatron's default ("full"), spelled as it asks, so it does not warn.
        cuda_graph_scope=[],
    )


def build_gpt_model(config: GPTConfig, seed: int) -> torch.nn.Module:
    """A freshly initialised policy; the same seed gives the same weights on the same device kind."""
    initialize_megatron(seed)
    with quiet_megatron():
        model: torch.nn.Module = GPTModel(
            config=transformer_config(config),
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=config.vocab_size,
            max_sequence_length=config.max_positions,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=False,
        )
    return model


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """megatron's mask convention: True marks a key a query must not see, shaped [1, 1, q, k]."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(diagonal=1)[None, None]


def forward_logits(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] for token ids [batch, seq], each position seeing only its past.

    Right padding is safe: a pad only follows the tokens it could disturb.
    """
    if token_ids.dim() != 2:
        raise ValueError(f"token_ids must be [batch, seq], got shape {tuple(token_ids.shape)}")
    batch, seq_len = token_ids.shape
    device = model_device(model)
    token_ids = token_ids.to(device)
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, seq_len)
    logits: torch.Tensor = model(token_ids, positions, attention_mask=causal_mask(seq_len, device))
    return logits


def token_logprobs(model: torch.nn.Module, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t] | token_ids[b, :t+1]) for every position, shaped [batch, seq].

    For next-token scoring pass targets = token_ids shifted left by one.
    """
    logits = forward_logits(model, token_ids).float()
    return logprobs_of(logits, targets.to(logits.device))


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position log-probabilities of `targets` under `logits` [batch, seq, vocab]."""
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
