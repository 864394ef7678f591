"""The agentic task: multi-term problems whose transcript calls the calculator, and the tool."""

from __future__ import annotations

import time

import pytest

from runtime.task.arithmetic import (
    TOOL_CALL_END,
    TaskConfig,
    generate_problems,
    make_calculator_problem,
    score,
)
from runtime.task.calculator import MAX_EXPRESSION_CHARS, Calculator, ToolCallError, evaluate
from runtime.task.tokenizer import CharTokenizer


def test_a_calculator_transcript_calls_the_tool_for_each_running_sum() -> None:
    problem = make_calculator_problem([12, 345, 67])
    assert problem.prompt_text == "12+345+67\n"
    assert problem.answer_text == "424"
    assert problem.full_solution_text == "12+345=357\n357+67=424\nA 424\n"
    assert score(problem, problem.full_solution_text) == 1.0
    with pytest.raises(ValueError, match="at least two terms"):
        make_calculator_problem([5])


def test_every_tool_answer_in_a_generated_transcript_is_what_the_calculator_says() -> None:
    """The warm start learns from these transcripts: each ``expr=`` must be followed by the
    calculator's own answer, so the model learns to call the tool the rollout really runs."""
    config = TaskConfig(max_digits=3, calculator=True, max_terms=5)
    calculator = Calculator()
    counts = set()
    for problem in generate_problems(300, seed=4, config=config):
        terms = problem.prompt_text.strip().split("+")
        counts.add(len(terms))
        lines = problem.full_solution_text.splitlines(keepends=True)
        assert len(lines) == len(terms)  # one call per term after the first, then the answer
        for line in lines[:-1]:
            expression, _, answer = line.partition(TOOL_CALL_END)
            assert calculator.call(expression) == answer
        assert lines[-1] == f"A {sum(int(t) for t in terms)}\n"
        CharTokenizer().encode(problem.prompt_text + problem.full_solution_text)  # in the vocabulary
        assert len(problem.prompt_text) <= config.longest_prompt_chars()
    # The term count is Zipf-drawn over 2..max_terms: all of them occur, two the most.
    assert counts == {2, 3, 4, 5}


def test_the_two_term_task_draws_the_same_problems_as_before_the_calculator_existed() -> None:
    """Jobs and cached warm starts keyed by a seed must keep their problem stream (these are the
    prompts seed 11 gave before the calculator variant was added)."""
    problems = generate_problems(5, seed=11, config=TaskConfig(max_digits=4))
    assert [p.prompt_text for p in problems] == ["8+7\n", "9+3\n", "8+7\n", "33+22\n", "2+1\n"]


def test_task_config_refuses_terms_without_the_calculator() -> None:
    with pytest.raises(ValueError, match="max_terms must be at least 2"):
        TaskConfig(calculator=True, max_terms=1)
    with pytest.raises(ValueError, match="needs calculator"):
        TaskConfig(max_terms=3)


def test_the_calculator_evaluates_integer_expressions_with_precedence() -> None:
    assert evaluate("12+345") == 357
    assert evaluate("2+3*4") == 14
    assert evaluate("2*3+4*5-6") == 20
    assert evaluate("7-9") == -2
    assert evaluate("0012") == 12
    assert Calculator().call("357+67") == "424\n"


@pytest.mark.parametrize(
    "expression", ["", "+", "1+", "+1", "1++2", "1+a", "(1+2)", "1 + 2", "1" * (MAX_EXPRESSION_CHARS + 1)]
)
def test_the_calculator_refuses_what_is_not_an_expression(expression: str) -> None:
    with pytest.raises(ToolCallError):
        Calculator().call(expression)


def test_the_calculator_takes_its_configured_latency() -> None:
    with pytest.raises(ValueError, match="latency_s"):
        Calculator(latency_s=-1.0)
    started = time.perf_counter()
    assert Calculator(latency_s=0.05).call("1+1") == "2\n"
    assert time.perf_counter() - started >= 0.05
