"""A tiny seeded CPU engine served on a free loopback port, and the client that drives it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from runtime.engine.client import EngineClient
from runtime.engine.cpu_engine import CpuEngine, EngineSettings
from runtime.engine.cpu_server import CpuEngineServer
from runtime.engine.model import GPT, GPTConfig, init_random_gpt

# The machine has two cores and other work runs beside these tests.
torch.set_num_threads(1)

TINY = GPTConfig(
    vocab_size=32, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, max_positions=256
)
# Peaky distributions: greedy runs are not one repeated token, and no two logits nearly tie.
WEIGHT_STD = 0.5
WAIT_S = 20.0


def make_model(seed: int) -> GPT:
    return init_random_gpt(TINY, seed=seed, std=WEIGHT_STD)


def greedy_reference(model: GPT, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation and its log-probs from full forward passes, no KV cache at all."""
    sequence = list(prompt)
    logprobs: list[float] = []
    for _ in range(new_tokens):
        log_probs = torch.log_softmax(model.full_logits(sequence)[-1], dim=-1)
        token = int(torch.argmax(log_probs))
        sequence.append(token)
        logprobs.append(float(log_probs[token]))
    return sequence[len(prompt) :], logprobs


@dataclass
class Served:
    engine: CpuEngine
    server: CpuEngineServer
    client: EngineClient

    def wait(self, predicate: Callable[[], bool], what: str) -> None:
        assert self.engine.wait_until(predicate, WAIT_S), f"timed out after {WAIT_S} s waiting for {what}"

    def wait_tokens(self, rid: str, count: int) -> None:
        self.wait(lambda: self.engine.generated_tokens(rid) >= count, f"{rid} to generate {count} tokens")


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """Start engines on free ports: ``serve(**EngineSettings fields)``; all stopped afterwards."""
    started: list[Served] = []

    def start(model_seed: int = 0, **settings: object) -> Served:
        engine = CpuEngine(TINY, EngineSettings(**settings), model=make_model(model_seed))  # type: ignore[arg-type]
        server = CpuEngineServer(engine, port=0)
        server.start()
        served = Served(engine, server, EngineClient(server.url, timeout_s=WAIT_S, generate_timeout_s=WAIT_S))
        started.append(served)
        return served

    yield start
    for served in started:
        served.client.close()
        served.server.stop()
