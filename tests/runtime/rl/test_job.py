"""The job's configuration, problems, request ids and warm-start cache."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import pytest
import torch

from runtime.model.config import GPTConfig
from runtime.rl.grpo import GRPOConfig
from runtime.rl.job import (
    RLJobConfig,
    iteration_problems,
    job_dataset,
    sample_rid,
    sample_seed,
)
from runtime.rl.warm_start import warm_start_cache_key, warm_start_weights
from runtime.task.arithmetic import TaskConfig
from runtime.task.tokenizer import EOS_ID, CharTokenizer

MODEL = GPTConfig(
    vocab_size=CharTokenizer().vocab_size,
    hidden_size=16,
    num_layers=1,
    num_heads=2,
    ffn_hidden_size=32,
    max_positions=48,
)
CONFIG = RLJobConfig(
    model=MODEL,
    task=TaskConfig(max_digits=3),
    seed=5,
    iterations=3,
    prompts_per_iteration=4,
    group_size=3,
    max_new_tokens=32,
    learning_rate=3e-4,
    micro_batch_size=6,
    grpo=GRPOConfig(clip_low=0.1, clip_high=0.3, kl_coef=0.02),
    warm_start_steps=3,
    warm_start_batch_size=4,
)


def test_the_config_round_trips_through_json_and_derives_the_trainer_and_warm_start_settings() -> None:
    text = CONFIG.to_json()
    assert json.loads(text)["grpo"]["kl_coef"] == 0.02
    assert RLJobConfig.from_json(text) == CONFIG
    # Only the model is required; everything else has a default that fits the default model.
    default_model = GPTConfig(vocab_size=MODEL.vocab_size)
    assert RLJobConfig.from_json(json.dumps({"model": dataclasses.asdict(default_model)})) == RLJobConfig(
        model=default_model
    )
    assert CONFIG.global_batch_size == 12
    trainer = CONFIG.trainer_config()
    assert (trainer.global_batch_size, trainer.micro_batch_size, trainer.learning_rate) == (12, 6, 3e-4)
    assert (trainer.seed, trainer.grpo, trainer.model) == (5, CONFIG.grpo, MODEL)
    sft = CONFIG.sft_config()
    assert (sft.steps, sft.batch_size, sft.seed, sft.task) == (3, 4, 5, CONFIG.task)
    settings = CONFIG.engine_settings(max_running_requests=7)
    assert (settings.eos_token_id, settings.weight_version, settings.max_running_requests) == (EOS_ID, "0", 7)
    params = CONFIG.sampling_params(seed=11)
    assert params == {
        "max_new_tokens": 32,
        "temperature": 1.0,
        "stop_token_ids": [EOS_ID],
        "sampling_seed": 11,
    }


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"group_size": 1}, "group_size"),
        ({"prompts_per_iteration": 0}, "prompts_per_iteration"),
        ({"iterations": 0}, "iterations"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"warm_start_steps": -1}, "warm_start_steps"),
        ({"seed": -1}, "seed"),
        ({"dataset_size": 0}, "dataset_size"),
        ({"dataset_size": 2.0}, "dataset_size"),
        ({"group_size": "4"}, "group_size"),
        ({"temperature": True}, "temperature"),
        ({"task": {"max_digits": 2}}, "task"),
        # The longest 3-digit prompt is 9 tokens; 9 + 40 does not fit 48 positions.
        ({"max_new_tokens": 40}, "max_new_tokens"),
        ({"model": dataclasses.replace(MODEL, vocab_size=21)}, "model.vocab_size"),
    ],
)
def test_invalid_settings_are_refused_naming_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"RLJobConfig\.{field}\b"):
        dataclasses.replace(CONFIG, **changes)


def test_json_with_unknown_or_malformed_fields_is_refused_naming_them() -> None:
    data = json.loads(CONFIG.to_json())
    with pytest.raises(ValueError, match=re.escape("unknown RLJobConfig fields: ['batch']")):
        RLJobConfig.from_json(json.dumps({**data, "batch": 3}))
    with pytest.raises(ValueError, match=re.escape("unknown RLJobConfig.grpo fields: ['beta']")):
        RLJobConfig.from_json(json.dumps({**data, "grpo": {"beta": 0.1}}))
    with pytest.raises(ValueError, match=re.escape("RLJobConfig.task: max_digits must be at least 1")):
        RLJobConfig.from_json(json.dumps({**data, "task": {"max_digits": 0}}))
    with pytest.raises(ValueError, match=re.escape("RLJobConfig.model is required")):
        RLJobConfig.from_json(json.dumps({"seed": 1}))
    with pytest.raises(ValueError, match=re.escape("RLJobConfig.model must be an object")):
        RLJobConfig.from_json(json.dumps({**data, "model": 3}))


def test_iteration_problems_depend_on_seed_and_iteration_only() -> None:
    first = iteration_problems(CONFIG, 0)
    assert len(first) == CONFIG.prompts_per_iteration
    assert iteration_problems(CONFIG, 0) == first
    assert iteration_problems(dataclasses.replace(CONFIG, learning_rate=1.0), 0) == first
    others = [iteration_problems(CONFIG, it) for it in range(1, 6)]
    assert all(problems != first for problems in others)
    assert iteration_problems(dataclasses.replace(CONFIG, seed=6), 0) != first
    assert all(p.num_digits <= 3 for problems in others for p in problems)
    with pytest.raises(ValueError, match="non-negative"):
        iteration_problems(CONFIG, -1)


def test_with_a_dataset_the_iterations_walk_through_it_epoch_after_epoch() -> None:
    config = dataclasses.replace(CONFIG, dataset_size=10, prompts_per_iteration=4)
    dataset = job_dataset(config)
    assert len({p.prompt_text for p in dataset}) == 10
    assert job_dataset(config) == dataset and job_dataset(CONFIG) == []
    assert iteration_problems(config, 1) == iteration_problems(config, 1)
    # Iterations 0-4 take positions 0-19: epoch 0 (positions 0-9) is every problem once, and
    # so is epoch 1, in another order.
    walked = [p for iteration in range(5) for p in iteration_problems(config, iteration)]
    first_epoch, second_epoch = walked[:10], walked[10:]
    assert sorted(p.prompt_text for p in first_epoch) == sorted(p.prompt_text for p in dataset)
    assert sorted(p.prompt_text for p in second_epoch) == sorted(p.prompt_text for p in dataset)
    assert first_epoch != second_epoch
    # One digit has only 100 distinct problems.
    with pytest.raises(ValueError, match=r"RLJobConfig\.dataset_size: the task gave only 100"):
        job_dataset(dataclasses.replace(config, task=TaskConfig(max_digits=1), dataset_size=101))


def test_sample_rids_are_unique_and_never_a_prefix_of_one_another() -> None:
    # Widths overflow on purpose (iteration 10**6, prompt 10**5, sample 10**6): the terminating
    # "." is what keeps the property, not the padding.
    rids = [
        sample_rid(job, iteration, prompt, sample)
        for job, iteration, prompt, sample in itertools.product(
            ("j", "j1", "j-i000001"), (1, 10, 10**6), (0, 1, 10, 10**5), (0, 1, 10, 10**6)
        )
    ]
    assert len(set(rids)) == len(rids)
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
    assert sample_rid("job7", 3, 2, 1) == "job7-i000003-p00002-s000001-a000."
    with pytest.raises(ValueError, match="must not contain"):
        sample_rid("job.7", 0, 0, 0)
    seeds = {sample_seed(CONFIG, 0, prompt, sample) for prompt in range(20) for sample in range(20)}
    assert len(seeds) == 400 and all(0 <= seed < 2**31 for seed in seeds)


def test_the_warm_start_is_cached_by_its_inputs_and_written_whole(tmp_path: Path) -> None:
    weights = warm_start_weights(CONFIG, cache_dir=tmp_path)
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"warm-start-{warm_start_cache_key(CONFIG)}"]
    assert sorted(p.name for p in files[0].iterdir()) == ["config.json", "model.safetensors"]
    # A second call reads the file: equal tensors, no new file, no temporary left behind.
    again = warm_start_weights(CONFIG, cache_dir=tmp_path)
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[name], weights[name]) for name in weights)
    assert list(tmp_path.iterdir()) == files
    # What the warm start depends on changes the key; what it does not (the RL settings) keeps it.
    assert warm_start_cache_key(dataclasses.replace(CONFIG, learning_rate=1.0)) == warm_start_cache_key(
        CONFIG
    )
    for changes in ({"seed": 6}, {"warm_start_steps": 4}, {"task": TaskConfig(max_digits=2)}):
        assert warm_start_cache_key(dataclasses.replace(CONFIG, **changes)) != warm_start_cache_key(CONFIG)
    # Uncached, the same config computes the same weights: the cache holds nothing else. And in a
    # process with more threads (a benchmark's, a test's) they are the driver's, bit for bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        fresh = warm_start_weights(CONFIG)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(fresh[name], weights[name]) for name in weights)
