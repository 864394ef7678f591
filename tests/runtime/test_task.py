"""The arithmetic task: tokenizer, problem generator, length distribution and reward."""

from __future__ import annotations

import random
import statistics

import pytest

from runtime.task.arithmetic import (
    ANSWER_MARKER,
    TaskConfig,
    generate_problems,
    make_problem,
    sample_problem,
    score,
    solution_lengths,
)
from runtime.task.tokenizer import BOS_ID, EOS_ID, CharTokenizer, UnknownCharacterError


def test_tokenizer_round_trips_every_problem_text() -> None:
    tokenizer = CharTokenizer()
    for problem in generate_problems(200, seed=1):
        text = problem.prompt_text + problem.full_solution_text
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == BOS_ID and ids[-1] == EOS_ID
        assert all(0 <= token < tokenizer.vocab_size for token in ids)
        assert tokenizer.decode(ids) == text


def test_tokenizer_ids_are_distinct_and_specials_are_not_text() -> None:
    tokenizer = CharTokenizer()
    ids = tokenizer.encode("0123456789+-*= \nA")
    assert len(set(ids)) == len(ids) == tokenizer.vocab_size - 3
    assert min(ids) == 3
    assert tokenizer.decode([BOS_ID, *tokenizer.encode("12"), EOS_ID, *tokenizer.encode("3")]) == "12"
    assert (
        tokenizer.decode([*tokenizer.encode("12"), EOS_ID, *tokenizer.encode("3")], stop_at_eos=False)
        == "123"
    )
    assert len(tokenizer.token_names()) == tokenizer.vocab_size


def test_tokenizer_rejects_text_and_ids_outside_its_vocabulary() -> None:
    tokenizer = CharTokenizer()
    with pytest.raises(UnknownCharacterError):
        tokenizer.encode("12x")
    with pytest.raises(ValueError):
        tokenizer.decode([tokenizer.vocab_size])


def test_reference_solution_works_column_by_column_with_carries() -> None:
    problem = make_problem(487, 356)
    assert problem.prompt_text == "487+356\n"
    assert problem.answer_text == "843"
    assert problem.full_solution_text == "7+6+0=13\n8+5+1=14\n4+3+1=08\nA 843\n"
    assert make_problem(99, 1).full_solution_text == "9+1+0=10\n9+0+1=10\nA 100\n"


def test_every_reference_solution_earns_the_reward_and_its_working_adds_up() -> None:
    for problem in generate_problems(300, seed=2):
        assert score(problem, problem.full_solution_text) == 1.0
        a, b = (int(part) for part in problem.prompt_text.strip().split("+"))
        assert int(problem.answer_text) == a + b
        assert len(str(a)) == len(str(b)) == problem.num_digits
        working = problem.full_solution_text.splitlines()[:-1]
        assert len(working) == problem.num_digits
        column_digits = [int(line.rsplit("=", 1)[1]) % 10 for line in working]
        final_carry = int(working[-1].rsplit("=", 1)[1]) // 10
        rebuilt = int("".join(str(d) for d in reversed(column_digits)))
        assert rebuilt + final_carry * 10**problem.num_digits == a + b


def test_problems_are_reproducible_from_their_seed() -> None:
    assert generate_problems(50, seed=7) == generate_problems(50, seed=7)
    assert generate_problems(50, seed=7) != generate_problems(50, seed=8)


def test_problem_sizes_follow_the_truncated_zipf_law() -> None:
    config = TaskConfig(max_digits=16, zipf_exponent=1.2)
    problems = generate_problems(4000, seed=3, config=config)
    sizes = [problem.num_digits for problem in problems]
    assert set(sizes) == set(range(1, 17))
    weights = config.size_weights()
    expected_one_digit = weights[0] / sum(weights)
    share_one_digit = sizes.count(1) / len(sizes)
    # Binomial standard deviation is under 0.008 at n=4000; allow five of them.
    assert abs(share_one_digit - expected_one_digit) < 0.04
    # Each size is rarer than the last, up to sampling noise in the thin tail.
    counts = [sizes.count(n) for n in range(1, 17)]
    assert counts[0] > counts[1] > counts[2] > counts[4] > counts[8] > counts[15]


def test_solution_lengths_are_heavy_tailed() -> None:
    lengths = sorted(solution_lengths(generate_problems(2000, seed=4)))
    median = statistics.median(lengths)
    p95 = lengths[int(0.95 * len(lengths))]
    # A light-tailed spread (say, sizes uniform over 1..16) has p95 / median under 2.
    assert p95 >= 4 * median
    assert max(lengths) >= 6 * median
    # Yet the mean stays near the bulk: most problems are short.
    assert statistics.mean(lengths) < 2.5 * median


def test_sample_problem_allows_zero_only_for_single_digits() -> None:
    rng = random.Random(5)
    for _ in range(500):
        problem = sample_problem(rng, TaskConfig(max_digits=3))
        for operand in problem.prompt_text.strip().split("+"):
            assert len(operand) == problem.num_digits
            assert problem.num_digits == 1 or not operand.startswith("0")


def test_task_config_rejects_impossible_distributions() -> None:
    with pytest.raises(ValueError):
        TaskConfig(max_digits=0)
    with pytest.raises(ValueError):
        TaskConfig(zipf_exponent=0)


@pytest.mark.parametrize(
    ("response", "reward"),
    [
        ("7+6+0=13\n8+5+1=14\n4+3+1=08\nA 843\n", 1.0),
        ("A 843", 1.0),
        ("A  843 \n", 1.0),
        ("A 843\nA 999\n", 1.0),
        ("A 844\n", 0.0),
        ("A 0843\n", 0.0),
        ("A 999\nA 843\n", 0.0),
        ("843\n", 0.0),
        ("", 0.0),
        ("A ", 0.0),
        ("AAAA\n\n+++===", 0.0),
        ("A 84 3", 0.0),
        ("\x00\ufffdA 843x", 0.0),
        ("garbage then A 843\n", 1.0),
    ],
)
def test_reward_is_exact_match_of_the_first_stated_answer(response: str, reward: float) -> None:
    problem = make_problem(487, 356)
    assert ANSWER_MARKER == "A "
    assert score(problem, response) == reward
