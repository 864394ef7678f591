"""The supervised warm start leaves a policy that is sometimes right."""

from __future__ import annotations

import itertools

import torch

from runtime.model.config import GPTConfig
from runtime.model.megatron_gpt import build_gpt_model
from runtime.model.sft import (
    exact_match_accuracy,
    greedy_decode,
    held_out_problems,
    length_bucketed_batches,
    solution_batch,
    supervised_warm_start,
)
from runtime.model.sft_config import SFTConfig
from runtime.task.arithmetic import iter_problems, make_problem
from runtime.task.tokenizer import CharTokenizer

torch.set_num_threads(1)

TOKENIZER = CharTokenizer()
CONFIG = GPTConfig(vocab_size=TOKENIZER.vocab_size)


def test_only_solution_tokens_are_trained() -> None:
    problem = make_problem(12, 34)
    batch = solution_batch([problem, make_problem(1, 2)], TOKENIZER)
    prompt_tokens = len(problem.prompt_text) + 1  # with BOS
    trained_targets = batch.targets[0][batch.loss_mask[0]].tolist()
    assert trained_targets == TOKENIZER.encode(problem.full_solution_text, add_eos=True)
    assert not batch.loss_mask[0, : prompt_tokens - 1].any()
    # The shorter row is padded, and padding is never a target.
    assert not batch.loss_mask[1][batch.targets[1] == TOKENIZER.pad_id].any()
    # Targets are the inputs shifted by one token.
    assert torch.equal(batch.inputs[0, 1:], batch.targets[0, :-1])


def test_length_bucketed_batches_keep_every_problem_once_and_group_similar_lengths() -> None:
    config = SFTConfig(batch_size=8, bucket_pool_batches=4, seed=3)
    batches = list(itertools.islice(length_bucketed_batches(iter_problems(3, config.task), config), 4))
    drawn = list(itertools.islice(iter_problems(3, config.task), 32))
    assert sorted(p.prompt_text for batch in batches for p in batch) == sorted(p.prompt_text for p in drawn)
    spans = [
        max(len(p.full_solution_text) for p in b) - min(len(p.full_solution_text) for p in b) for b in batches
    ]
    overall = max(len(p.full_solution_text) for p in drawn) - min(len(p.full_solution_text) for p in drawn)
    assert sum(spans) <= overall


def test_greedy_decode_is_deterministic_and_batches_equal_length_prompts() -> None:
    model = build_gpt_model(CONFIG, seed=1)
    prompts = ["12+34\n", "56+78\n", "5+5\n"]
    together = greedy_decode(model, TOKENIZER, prompts, max_new_tokens=12, max_positions=CONFIG.max_positions)
    alone = [greedy_decode(model, TOKENIZER, [p], 12, CONFIG.max_positions)[0] for p in prompts]
    assert together == alone
    assert all(len(response) <= 12 for response in together)


def test_warm_start_makes_greedy_decoding_sometimes_right_on_held_out_problems() -> None:
    seed = 0
    model = build_gpt_model(CONFIG, seed=seed)
    config = SFTConfig(seed=seed)
    evaluation = held_out_problems(64, seed=seed + 10_000, exclude=(), task=config.task)
    before = exact_match_accuracy(model, TOKENIZER, evaluation, CONFIG.max_positions)

    result = supervised_warm_start(model, TOKENIZER, config)
    after = exact_match_accuracy(model, TOKENIZER, evaluation, CONFIG.max_positions)

    assert len(result.losses) == config.steps
    assert sum(result.losses[-20:]) / 20 < 0.6 * sum(result.losses[:20]) / 20
    # Seeds 0-2 measured 0.00 before and 0.22-0.30 after (64 fresh problems of this distribution).
    assert before <= 0.05
    assert after >= before + 0.1
    assert after < 1.0
