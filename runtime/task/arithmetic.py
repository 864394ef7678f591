"""Synthetic multi-digit addition where the model writes its working before the answer.

A problem of size n adds two n-digit numbers. The reference solution works column by column
from the least significant digit, one line per column (``x+y+carry=ss``: the column's digits,
the carry in, and the two-digit column sum whose tens digit is the next carry), then states the
answer after the marker::

    prompt:    "487+356\\n"
    solution:  "7+6+0=13\\n8+5+1=14\\n4+3+1=08\\nA 843\\n"

Sizes are drawn from a Zipf law truncated to 1..max_digits, so most problems are short and a
few are long: response lengths vary by an order of magnitude with a long tail, which is the
load shape dynarl schedules. Everything comes from a seeded `random.Random`; nothing is
downloaded.

The agentic variant (``TaskConfig.calculator``) adds 2..max_terms operands (their count drawn
from the same Zipf law) and leaves the sums to a calculator tool: the model writes a step's
expression up to ``=``, generation stops there, the tool appends the value and a newline (tool
output, not the model's), and the model goes on from the running total::

    prompt:    "12+345+67\n"
    solution:  "12+345=357\n357+67=424\nA 424\n"       (``357\n`` and ``424\n`` from the tool)

so an episode takes one turn per tool call plus a final one, and every turn's context extends
the last one's: the KV-cache reuse the DataRouter keeps by sending a turn to the engine that
served the one before.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

ANSWER_MARKER = "A "
# The model ends a calculator call with this character; the tool answers "<value>\n".
TOOL_CALL_END = "="


@dataclass(frozen=True)
class Problem:
    """One addition: what the model is shown, the expected answer and the worked solution."""

    prompt_text: str
    answer_text: str
    full_solution_text: str
    num_digits: int


@dataclass(frozen=True)
class TaskConfig:
    """The size distribution: P(n digits) is proportional to n ** -zipf_exponent on 1..max_digits."""

    max_digits: int = 16
    zipf_exponent: float = 1.2
    # The agentic variant: 2..max_terms operands (Zipf-drawn count), summed with a calculator.
    calculator: bool = False
    max_terms: int = 2

    def __post_init__(self) -> None:
        if self.max_digits < 1:
            raise ValueError("max_digits must be at least 1")
        if self.zipf_exponent <= 0:
            raise ValueError("zipf_exponent must be positive")
        if self.max_terms < 2:
            raise ValueError("max_terms must be at least 2")
        if self.max_terms > 2 and not self.calculator:
            raise ValueError("max_terms above 2 needs calculator: the worked solution adds two numbers")

    def longest_prompt_chars(self) -> int:
        """The longest prompt: ``max_terms`` operands, the ``+`` between them and the newline."""
        return self.max_terms * self.max_digits + self.max_terms

    def term_count_weights(self) -> list[float]:
        return [n**-self.zipf_exponent for n in range(1, self.max_terms)]

    def size_weights(self) -> list[float]:
        return [n**-self.zipf_exponent for n in range(1, self.max_digits + 1)]


def worked_solution(a: int, b: int) -> str:
    """The reference working and answer for a + b, column by column from the right."""
    width = max(len(str(a)), len(str(b)))
    digits_a = str(a).zfill(width)[::-1]
    digits_b = str(b).zfill(width)[::-1]
    lines = []
    carry = 0
    for x, y in zip(digits_a, digits_b, strict=True):
        column = int(x) + int(y) + carry
        lines.append(f"{x}+{y}+{carry}={column:02d}\n")
        carry = column // 10
    return "".join(lines) + f"{ANSWER_MARKER}{a + b}\n"


def make_problem(a: int, b: int) -> Problem:
    width = max(len(str(a)), len(str(b)))
    return Problem(
        prompt_text=f"{a}+{b}\n",
        answer_text=str(a + b),
        full_solution_text=worked_solution(a, b),
        num_digits=width,
    )


def calculator_solution(terms: Sequence[int]) -> str:
    """The transcript of summing ``terms`` with the calculator: one ``total+term=`` call per
    term after the first, each answered by the tool, then the answer."""
    total = terms[0]
    lines = []
    for term in terms[1:]:
        lines.append(f"{total}+{term}{TOOL_CALL_END}{total + term}\n")
        total += term
    return "".join(lines) + f"{ANSWER_MARKER}{total}\n"


def make_calculator_problem(terms: Sequence[int]) -> Problem:
    if len(terms) < 2:
        raise ValueError("a calculator problem has at least two terms")
    return Problem(
        prompt_text="+".join(str(term) for term in terms) + "\n",
        answer_text=str(sum(terms)),
        full_solution_text=calculator_solution(terms),
        num_digits=max(len(str(term)) for term in terms),
    )


def _operand(rng: random.Random, config: TaskConfig) -> int:
    """A Zipf-drawn size n, then a uniform n-digit number (n = 1 allows 0)."""
    n = rng.choices(range(1, config.max_digits + 1), weights=config.size_weights())[0]
    low = 0 if n == 1 else 10 ** (n - 1)
    return rng.randint(low, 10**n - 1)


def sample_problem(rng: random.Random, config: TaskConfig = TaskConfig()) -> Problem:
    """One problem: a Zipf-drawn size n, then two uniform n-digit operands (n = 1 allows 0).

    A calculator problem draws its number of terms first (2 + a Zipf draw on 0..max_terms-2),
    then each term's size on its own."""
    if config.calculator:
        count = 1 + rng.choices(range(1, config.max_terms), weights=config.term_count_weights())[0]
        return make_calculator_problem([_operand(rng, config) for _ in range(count)])
    sizes = range(1, config.max_digits + 1)
    n = rng.choices(sizes, weights=config.size_weights())[0]
    low = 0 if n == 1 else 10 ** (n - 1)
    high = 10**n - 1
    return make_problem(rng.randint(low, high), rng.randint(low, high))


def iter_problems(seed: int, config: TaskConfig = TaskConfig()) -> Iterator[Problem]:
    """An endless seeded stream of problems; the same seed gives the same stream."""
    rng = random.Random(seed)
    while True:
        yield sample_problem(rng, config)


def generate_problems(count: int, seed: int, config: TaskConfig = TaskConfig()) -> list[Problem]:
    stream = iter_problems(seed, config)
    return [next(stream) for _ in range(count)]


def extract_answer(response_text: str) -> str | None:
    """The text after the first answer marker, up to the end of its line; None without a marker.

    Only the first marker counts, so writing several answers never earns more than writing one.
    """
    _, found, rest = response_text.partition(ANSWER_MARKER)
    if not found:
        return None
    return rest.split("\n", 1)[0].strip()


def score(problem: Problem, response_text: str) -> float:
    """Rule-based exact-match reward: 1.0 when the stated answer equals the sum, else 0.0."""
    stated = extract_answer(response_text)
    return 1.0 if stated is not None and stated == problem.answer_text else 0.0


def solution_lengths(problems: Sequence[Problem]) -> list[int]:
    """Characters in each reference solution (tokens, with the character tokenizer)."""
    return [len(problem.full_solution_text) for problem in problems]
