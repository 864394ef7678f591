"""The supervised warm start's settings (`runtime.model.sft` runs it).

Apart from the training code so that a job's configuration, which carries these, is read without
importing the training stack (megatron-core).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.task.arithmetic import TaskConfig


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 500
    batch_size: int = 16
    learning_rate: float = 5e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    seed: int = 0
    # Batches drawn together and sorted by length before being cut (see length_bucketed_batches).
    bucket_pool_batches: int = 8
    task: TaskConfig = field(default_factory=TaskConfig)
