"""Sampling parameters (SGLang's names and defaults) and the sampler of the CPU engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# SGLang treats a temperature below this as greedy decoding.
GREEDY_TEMPERATURE = 1e-6

# Accepted with their SGLang defaults only: the CPU engine has no tokenizer and no penalties.
_INERT_AT_DEFAULT: dict[str, Any] = {
    "n": 1,
    "stop": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "logit_bias": None,
}
# Only shape text that the CPU engine never produces, so any value is harmless.
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


@dataclass(frozen=True)
class SamplingParams:
    """The subset of SGLang's ``sampling_params`` the CPU engine implements, with SGLang's defaults."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @classmethod
    def from_request(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """Parse a request's ``sampling_params``; raises ValueError naming what is not supported."""
        raw = dict(raw or {})
        for name, default in _INERT_AT_DEFAULT.items():
            value = raw.pop(name, default)
            if value not in (default, [], ""):
                raise ValueError(f"sampling_params.{name}={value!r} is not supported by the CPU engine")
        for name in _TEXT_ONLY:
            raw.pop(name, None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s): {', '.join(unknown)}")
        stop_token_ids = raw.pop("stop_token_ids", None) or ()
        params = cls(
            stop_token_ids=tuple(int(token) for token in stop_token_ids),
            **{name: value for name, value in raw.items() if value is not None},
        )
        params.validate()
        return params

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Draw the next token from one row of logits; returns (token id, its log-probability).

    The log-probability is that of the temperature-scaled distribution before top-k/top-p
    truncation (greedy decoding reports it under temperature 1), which is what SGLang returns by
    default and what a trainer compares its own log-probabilities against.
    """
    logits = logits.float()
    if params.greedy:
        token = int(torch.argmax(logits).item())
        return token, float(torch.log_softmax(logits, dim=-1)[token].item())
    log_probs = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = log_probs.exp()
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        threshold = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest head of the distribution whose mass reaches top_p.
        sorted_probs = torch.where(mass_before < params.top_p * sorted_probs.sum(), sorted_probs, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=generator).item())
    return token, float(log_probs[token].item())
