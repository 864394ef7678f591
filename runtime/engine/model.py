"""The CPU engine's own GPT forward pass, in plain torch, with a slot-based KV cache.

The parameter names below are a contract: the trainer side converts its weights into exactly
these names and shapes before pushing them to an engine (from disk or over a process group).

- ``tok_emb.weight`` [V, H]; ``pos_emb.weight`` [P, H]
- per layer ``i``: ``layers.{i}.ln1.weight/bias`` [H];
  ``layers.{i}.attn.qkv.weight`` [3H, H] = [all q rows; all k rows; all v rows], heads contiguous
  inside each block (head h owns rows h*d .. (h+1)*d), ``layers.{i}.attn.qkv.bias`` [3H];
  ``layers.{i}.attn.proj.weight`` [H, H] / ``.bias`` [H]; ``layers.{i}.ln2.weight/bias`` [H];
  ``layers.{i}.mlp.fc1.weight`` [F, H] / ``.bias`` [F]; ``layers.{i}.mlp.fc2.weight`` [H, F] / ``.bias`` [H]
- ``ln_f.weight/bias`` [H]; ``lm_head.weight`` [V, H] (no bias)

The shape is ``runtime.model.config.GPTConfig``, the one the trainer builds from. Pre-LN blocks,
LayerNorm eps ``config.layernorm_epsilon`` (1e-5), exact (erf) GELU, attention scale 1/sqrt(head_dim), causal,
learned absolute positions.

KV layout: one pool per layer of shape [slots, heads, max_positions, head_dim] for keys and one
for values. A running request owns one slot; its token at position p has its key/value at
``[slot, :, p]``. A decode step writes each request's new key/value in place, gathers the running
slots' keys/values up to the longest length in the batch, and masks every position past each
request's own length: ragged lengths cost padding up to the longest request and a mask, and a
request's KV never moves while it runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.config import GPTConfig

__all__ = ["GPT", "GPTConfig", "KvPool", "expected_parameter_shapes", "gpt_from_weights", "init_random_gpt"]


class KvPool:
    """Keys and values of every running request, one slot per request."""

    def __init__(self, config: GPTConfig, num_slots: int, dtype: torch.dtype = torch.float32) -> None:
        shape = (num_slots, config.num_heads, config.max_positions, config.head_dim)
        self.num_slots = num_slots
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]

    def read_span(self, slot: int, start: int, end: int) -> torch.Tensor:
        """KV of positions [start, end) of one slot as [layers, 2, heads, end-start, head_dim]."""
        return torch.stack(
            [
                torch.stack((keys[slot, :, start:end], values[slot, :, start:end]))
                for keys, values in zip(self.keys, self.values, strict=True)
            ]
        ).clone()

    def write_span(self, slot: int, start: int, kv: torch.Tensor) -> None:
        """Inverse of :meth:`read_span`: place cached KV at positions [start, start+len)."""
        length = kv.shape[3]
        for layer, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            keys[slot, :, start : start + length] = kv[layer, 0]
            values[slot, :, start : start + length] = kv[layer, 1]


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, H] -> q, k, v each [B, heads, T, head_dim] (q rows, then k rows, then v rows)."""
        batch, length, _ = x.shape
        q, k, v = (
            t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
            for t in self.qkv(x).split(self.num_heads * self.head_dim, dim=-1)
        )
        return q, k, v

    def merge_heads(self, attended: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attended.shape
        out: torch.Tensor = self.proj(attended.transpose(1, 2).reshape(batch, length, -1))
        return out


class Mlp(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x), approximate="none"))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = Mlp(config)


class GPT(nn.Module):
    """Decoder-only transformer whose forward passes read and write a :class:`KvPool`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_emb = nn.Embedding(config.max_positions, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def blocks(self) -> list[Block]:
        return [layer for layer in self.layers if isinstance(layer, Block)]

    @torch.no_grad()
    def extend(self, pool: KvPool, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        """Prefill ``token_ids`` at positions start.. of one slot whose positions < start are
        already in the pool (a prefix-cache hit or earlier work). Returns the logits of the last
        token, [vocab]."""
        hidden = self._extend_hidden(pool, slot, token_ids, start)
        logits: torch.Tensor = self.lm_head(self.ln_f(hidden[-1]))
        return logits

    @torch.no_grad()
    def extend_all_logits(self, pool: KvPool, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        """As :meth:`extend`, but the logits of every extended token, [len(token_ids), vocab]:
        row i predicts the token after position start+i (input-token log-probs need them all)."""
        hidden = self._extend_hidden(pool, slot, token_ids, start)
        logits: torch.Tensor = self.lm_head(self.ln_f(hidden))
        return logits

    def _extend_hidden(self, pool: KvPool, slot: int, token_ids: list[int], start: int) -> torch.Tensor:
        """The final hidden states [len(token_ids), H] of a prefill, writing its KV into the slot."""
        length = len(token_ids)
        end = start + length
        tokens = torch.tensor(token_ids, dtype=torch.long).unsqueeze(0)
        positions = torch.arange(start, end).unsqueeze(0)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        # Query i sits at absolute position start+i and sees keys 0..start+i.
        visible = torch.arange(end).unsqueeze(0) <= (torch.arange(length) + start).unsqueeze(1)
        scale = 1.0 / math.sqrt(self.config.head_dim)
        for layer, block in enumerate(self.blocks()):
            q, k, v = block.attn.split_heads(block.ln1(x))
            pool.keys[layer][slot, :, start:end] = k[0]
            pool.values[layer][slot, :, start:end] = v[0]
            keys = pool.keys[layer][slot : slot + 1, :, :end]
            values = pool.values[layer][slot : slot + 1, :, :end]
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
            x = x + block.attn.merge_heads(attended)
            x = x + block.mlp(block.ln2(x))
        hidden: torch.Tensor = x[0]
        return hidden

    @torch.no_grad()
    def decode(
        self, pool: KvPool, slots: list[int], token_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """One decode step for a batch: request b feeds ``token_ids[b]`` at ``positions[b]`` into
        ``slots[b]``. Returns next-token logits [batch, vocab]."""
        slot_index = torch.tensor(slots, dtype=torch.long)
        position_index = torch.tensor(positions, dtype=torch.long)
        span = max(positions) + 1
        tokens = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)
        x = self.tok_emb(tokens) + self.pos_emb(position_index.unsqueeze(1))
        # [B, 1, 1, span]: request b attends to its own positions 0..positions[b] only.
        visible = (torch.arange(span).unsqueeze(0) <= position_index.unsqueeze(1))[:, None, None, :]
        scale = 1.0 / math.sqrt(self.config.head_dim)
        for layer, block in enumerate(self.blocks()):
            q, k, v = block.attn.split_heads(block.ln1(x))
            pool.keys[layer][slot_index, :, position_index] = k[:, :, 0]
            pool.values[layer][slot_index, :, position_index] = v[:, :, 0]
            keys = pool.keys[layer][slot_index, :, :span]
            values = pool.values[layer][slot_index, :, :span]
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)
            x = x + block.attn.merge_heads(attended)
            x = x + block.mlp(block.ln2(x))
        logits: torch.Tensor = self.lm_head(self.ln_f(x[:, 0]))
        return logits

    @torch.no_grad()
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence without any cache (a reference for checks)."""
        length = len(token_ids)
        tokens = torch.tensor(token_ids, dtype=torch.long).unsqueeze(0)
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(length).unsqueeze(0))
        scale = 1.0 / math.sqrt(self.config.head_dim)
        for block in self.blocks():
            q, k, v = block.attn.split_heads(block.ln1(x))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            x = x + block.attn.merge_heads(attended)
            x = x + block.mlp(block.ln2(x))
        logits: torch.Tensor = self.lm_head(self.ln_f(x[0]))
        return logits


def expected_parameter_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the contract with its shape."""
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "tok_emb.weight": (config.vocab_size, hidden),
        "pos_emb.weight": (config.max_positions, hidden),
        "ln_f.weight": (hidden,),
        "ln_f.bias": (hidden,),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for i in range(config.num_layers):
        prefix = f"layers.{i}."
        shapes.update(
            {
                prefix + "ln1.weight": (hidden,),
                prefix + "ln1.bias": (hidden,),
                prefix + "attn.qkv.weight": (3 * hidden, hidden),
                prefix + "attn.qkv.bias": (3 * hidden,),
                prefix + "attn.proj.weight": (hidden, hidden),
                prefix + "attn.proj.bias": (hidden,),
                prefix + "ln2.weight": (hidden,),
                prefix + "ln2.bias": (hidden,),
                prefix + "mlp.fc1.weight": (ffn, hidden),
                prefix + "mlp.fc1.bias": (ffn,),
                prefix + "mlp.fc2.weight": (hidden, ffn),
                prefix + "mlp.fc2.bias": (hidden,),
            }
        )
    return shapes


def init_random_gpt(config: GPTConfig, seed: int, std: float = 0.02) -> GPT:
    """A seeded random model (GPT-2 style init with weights ~ N(0, std)), for tests and for an
    engine started without weights; a larger ``std`` gives peakier next-token distributions."""
    generator = torch.Generator().manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, std, generator=generator)
    model.eval()
    return model


def gpt_from_weights(config: GPTConfig, weights: Mapping[str, torch.Tensor]) -> GPT:
    """A model holding ``weights`` (every parameter of the contract, e.g. a warm start's), to
    start an engine with."""
    model = GPT(config)
    model.load_state_dict(dict(weights), strict=True)
    model.eval()
    return model
