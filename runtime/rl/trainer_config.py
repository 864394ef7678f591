"""What the trainer is built with: its model, batch shape, optimizer and GRPO objective.

Apart from `runtime.rl.trainer` so that what reads a job's configuration (a node agent placing
the trainer's ranks) does not import the training stack (megatron-core) with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.model.config import GPTConfig
from runtime.rl.grpo import GRPOConfig
from runtime.task.tokenizer import PAD_ID


@dataclass(frozen=True)
class TrainerConfig:
    model: GPTConfig
    global_batch_size: int
    micro_batch_size: int
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    seed: int = 0
    pad_id: int = PAD_ID
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def __post_init__(self) -> None:
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("global_batch_size and micro_batch_size must be positive")
        if self.learning_rate <= 0:
            raise ValueError("learning_rate must be positive")
