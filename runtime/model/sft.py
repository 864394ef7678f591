"""Supervised warm start: teach the fresh policy the task's worked solutions before RL.

Cross-entropy on the solution tokens only (the prompt is context, not a target), AdamW, a fixed
seed for the weights, the problem stream and the batch order. A few hundred small steps leave a
policy that solves the short problems often and the long ones rarely, so RL starts from a
policy that is sometimes right. `greedy_decode` and `exact_match_accuracy` measure that.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.model.megatron_gpt import forward_logits, model_device
from runtime.model.sft_config import SFTConfig
from runtime.task.arithmetic import Problem, TaskConfig, iter_problems, score
from runtime.task.tokenizer import CharTokenizer


@dataclass
class SFTResult:
    losses: list[float]
    seen_prompts: set[str]
    seconds: float


@dataclass(frozen=True)
class TokenBatch:
    """Right-padded next-token data: inputs and targets [batch, seq], loss_mask marks trained targets."""

    inputs: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor


def solution_batch(problems: Sequence[Problem], tokenizer: CharTokenizer) -> TokenBatch:
    """BOS + prompt + solution + EOS per problem; only the solution and EOS are targets."""
    rows: list[list[int]] = []
    trained: list[list[bool]] = []
    for problem in problems:
        prompt = tokenizer.encode(problem.prompt_text, add_bos=True)
        solution = tokenizer.encode(problem.full_solution_text, add_eos=True)
        ids = prompt + solution
        rows.append(ids)
        # Target t is ids[t + 1]: the first solution token is predicted from the prompt's last.
        trained.append([False] * (len(prompt) - 1) + [True] * len(solution))
    width = max(len(ids) for ids in rows) - 1
    inputs = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, (ids, mask) in enumerate(zip(rows, trained, strict=True)):
        inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        targets[row, : len(ids) - 1] = torch.tensor(ids[1:])
        loss_mask[row, : len(mask)] = torch.tensor(mask)
    return TokenBatch(inputs, targets, loss_mask)


def solution_loss(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Mean cross-entropy over the trained targets of the batch."""
    logits = forward_logits(model, batch.inputs).float()
    device = logits.device
    per_token = F.cross_entropy(logits.transpose(1, 2), batch.targets.to(device), reduction="none")
    mask = batch.loss_mask.to(device)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def length_bucketed_batches(problems: Iterator[Problem], config: SFTConfig) -> Iterator[list[Problem]]:
    """Batches of similar solution length, in seeded random order.

    Lengths are long-tailed, so a random batch is mostly padding up to its one long problem;
    sorting a pool of several batches first keeps the padding (and the step time) small.
    """
    order = random.Random(config.seed)
    pool_size = config.batch_size * config.bucket_pool_batches
    while True:
        pool = sorted(itertools.islice(problems, pool_size), key=lambda p: len(p.full_solution_text))
        chunks = [pool[i : i + config.batch_size] for i in range(0, pool_size, config.batch_size)]
        order.shuffle(chunks)
        yield from chunks


def supervised_warm_start(model: torch.nn.Module, tokenizer: CharTokenizer, config: SFTConfig) -> SFTResult:
    """Train `model` in place on the reference solutions of a seeded problem stream."""
    started = time.perf_counter()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    warmup = max(config.warmup_steps, 1)

    def learning_rate_scale(step: int) -> float:
        # Linear warmup, then linear decay to a tenth, so the last steps settle instead of jitter.
        if step < warmup:
            return (step + 1) / warmup
        remaining = (config.steps - step) / max(config.steps - warmup, 1)
        return 0.1 + 0.9 * max(remaining, 0.0)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_scale)
    batches = length_bucketed_batches(iter_problems(config.seed, config.task), config)
    losses: list[float] = []
    seen: set[str] = set()
    model.train()
    for problems in itertools.islice(batches, config.steps):
        seen.update(problem.prompt_text for problem in problems)
        loss = solution_loss(model, solution_batch(problems, tokenizer))
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return SFTResult(losses=losses, seen_prompts=seen, seconds=time.perf_counter() - started)


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module,
    tokenizer: CharTokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    max_positions: int,
) -> list[str]:
    """The argmax continuation of each prompt until EOS, recomputing the full sequence each step.

    Prompts of equal length decode together as one batch, so no padding is needed.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    encoded = [tokenizer.encode(prompt, add_bos=True) for prompt in prompts]
    for index, ids in enumerate(encoded):
        by_length[len(ids)].append(index)
    outputs: list[list[int]] = [[] for _ in prompts]
    device = model_device(model)
    for length, indices in by_length.items():
        sequence = torch.tensor([encoded[i] for i in indices], dtype=torch.long, device=device)
        finished = torch.zeros(len(indices), dtype=torch.bool, device=device)
        for _ in range(min(max_new_tokens, max_positions - length)):
            next_ids = forward_logits(model, sequence)[:, -1].argmax(dim=-1)
            next_ids = torch.where(finished, torch.full_like(next_ids, tokenizer.pad_id), next_ids)
            sequence = torch.cat([sequence, next_ids[:, None]], dim=1)
            finished |= next_ids == tokenizer.eos_id
            if bool(finished.all()):
                break
        for row, index in enumerate(indices):
            outputs[index] = sequence[row, length:].tolist()
    return [tokenizer.decode(ids) for ids in outputs]


def exact_match_accuracy(
    model: torch.nn.Module,
    tokenizer: CharTokenizer,
    problems: Sequence[Problem],
    max_positions: int,
    slack_tokens: int = 8,
) -> float:
    """Share of problems whose greedy response earns reward 1.

    Each problem size decodes with its own budget (its longest reference solution + EOS + slack),
    so a policy that never stops costs time in proportion to the problems, not to the longest.
    """
    if not problems:
        raise ValueError("no problems to evaluate")
    by_size: dict[int, list[Problem]] = defaultdict(list)
    for problem in problems:
        by_size[problem.num_digits].append(problem)
    total = 0.0
    for group in by_size.values():
        budget = max(len(problem.full_solution_text) for problem in group) + 1 + slack_tokens
        responses = greedy_decode(model, tokenizer, [p.prompt_text for p in group], budget, max_positions)
        total += sum(score(problem, response) for problem, response in zip(group, responses, strict=True))
    return total / len(problems)


def held_out_problems(count: int, seed: int, exclude: Iterable[str], task: TaskConfig) -> list[Problem]:
    """`count` problems from a seeded stream whose prompts are not in `exclude` (e.g. trained on)."""
    excluded = set(exclude)
    fresh = (problem for problem in iter_problems(seed, task) if problem.prompt_text not in excluded)
    return list(itertools.islice(fresh, count))
