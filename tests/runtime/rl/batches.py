"""Shared by the trainer tests: a tiny model config, fixed GRPO batches, and the DP rank body
(a module-level function, so torch.multiprocessing's spawn can import it in the child)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch._C import _distributed_c10d as c10d

from runtime.model.config import GPTConfig
from runtime.model.megatron_gpt import build_gpt_model
from runtime.rl.grpo import GRPOConfig, Trajectory
from runtime.rl.trainer import DataParallelRendezvous, Trainer, response_logprobs
from runtime.rl.trainer_config import TrainerConfig
from runtime.task.arithmetic import TaskConfig, generate_problems
from runtime.task.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer()
TINY = GPTConfig(
    vocab_size=TOKENIZER.vocab_size,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    ffn_hidden_size=64,
    max_positions=96,
)
SEED = 0


def trainer_config(
    global_batch_size: int, micro_batch_size: int, learning_rate: float = 1e-3
) -> TrainerConfig:
    return TrainerConfig(
        model=TINY,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        learning_rate=learning_rate,
        seed=SEED,
        grpo=GRPOConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.05),
    )


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A response that skips the working and states a wrong sum: it differs from the reference
    solution from its first token, so no prefix is shared between right and wrong responses."""
    return f"A {int(answer) + rng.randint(1, 9)}\n"


def grpo_batch(groups: int, per_group: int, seed: int, logprob_noise: float) -> list[Trajectory]:
    """Groups of responses to small addition problems, right (reward 1) or wrong (reward 0).

    Sampling and reference log-probs are the seeded initial policy's, perturbed by
    ``logprob_noise`` so that ratios differ from one and some tokens clip.
    """
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    problems = generate_problems(groups, seed, TaskConfig(max_digits=3))
    drafts: list[Trajectory] = []
    for group, problem in enumerate(problems):
        prompt = tuple(TOKENIZER.encode(problem.prompt_text, add_bos=True))
        for member in range(per_group):
            right = member % 2 == 0
            text = problem.full_solution_text if right else wrong_answer(problem.answer_text, rng)
            response = tuple(TOKENIZER.encode(text, add_eos=True))
            drafts.append(
                Trajectory(
                    prompt_ids=prompt,
                    response_ids=response,
                    sampling_logprobs=(0.0,) * len(response),
                    weight_versions=("0",) * len(response),
                    reward=1.0 if right else 0.0,
                    group_id=f"g{group}",
                )
            )
    initial = response_logprobs(build_gpt_model(TINY, seed=SEED), drafts, TOKENIZER.pad_id)
    samples: list[Trajectory] = []
    for draft, logprobs in zip(drafts, initial, strict=True):
        sampling = torch.tensor(logprobs) + logprob_noise * torch.randn(len(logprobs), generator=generator)
        reference = torch.tensor(logprobs) + logprob_noise * torch.randn(len(logprobs), generator=generator)
        samples.append(
            Trajectory(
                prompt_ids=draft.prompt_ids,
                response_ids=draft.response_ids,
                sampling_logprobs=tuple(sampling.tolist()),
                weight_versions=draft.weight_versions,
                reward=draft.reward,
                group_id=draft.group_id,
                reference_logprobs=tuple(reference.tolist()),
            )
        )
    return samples


def train_and_save(
    rank: int,
    world_size: int,
    store_path: str,
    batches: list[list[Trajectory]],
    micro_batch_size: int,
    out_dir: str,
) -> None:
    """One DP rank: train on every global batch in turn, then save its weights and metrics."""
    torch.set_num_threads(1)
    store = c10d.FileStore(store_path, world_size)
    rendezvous = DataParallelRendezvous(store=store, rank=rank, world_size=world_size, timeout_s=60)
    trainer = Trainer(trainer_config(len(batches[0]), micro_batch_size), rendezvous)
    metrics = [trainer.train_step(batch) for batch in batches]
    torch.save(
        {"weights": trainer.engine_weights(), "metrics": metrics},
        Path(out_dir) / f"rank{rank}.pt",
    )
    trainer.close()
