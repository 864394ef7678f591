"""The shape of the tiny causal LM every part of the runtime agrees on."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-style decoder: pre-LayerNorm blocks, learned absolute positions, untied output head."""

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int = 256
    max_positions: int = 256
    layernorm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "ffn_hidden_size",
            "max_positions",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GPTConfig:
        data: dict[str, Any] = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {sorted(unknown)}")
        return cls(**data)
