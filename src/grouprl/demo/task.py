"""A procedural arithmetic task with a verifiable reward.

Prompts are two-operand additions such as ``"12+7="``; the answer is the sum as a string (``"19"``).
The task is small enough for a ~0.5M-parameter model yet has a crisp, programmatic reward, which is
exactly what a GRPO demo needs: no reward model, no labels beyond the sum itself.
"""

from __future__ import annotations

import random
from typing import Any

from datasets import Dataset

from grouprl.rewards.arithmetic import arithmetic_reward, parse_answer

__all__ = [
    "MAX_OPERAND",
    "arithmetic_reward",
    "format_problem",
    "make_arithmetic_dataset",
    "parse_answer",
    "sample_problems",
]

MAX_OPERAND = 49
"""Operands are drawn uniformly from ``0..MAX_OPERAND`` (sums range over 0..98)."""


def format_problem(a: int, b: int) -> str:
    """The standard-format prompt text for ``a + b``: ``"a+b="`` (no spaces, no trailing newline)."""
    return f"{a}+{b}="


def sample_problems(num_rows: int, seed: int = 0, max_operand: int = MAX_OPERAND) -> list[tuple[int, int]]:
    """Draw ``num_rows`` operand pairs uniformly from ``0..max_operand`` with a private RNG (so the
    global ``random`` state is neither used nor disturbed)."""
    rng = random.Random(seed)
    return [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(num_rows)]


def make_arithmetic_dataset(
    num_rows: int, seed: int = 0, conversational: bool = False, max_operand: int = MAX_OPERAND
) -> Dataset:
    """Build a dataset of addition problems with columns ``prompt`` and ``answer``.

    Args:
        num_rows: number of rows (problems may repeat; they are sampled independently).
        seed: RNG seed; the same seed always gives the same rows.
        conversational: if False, ``prompt`` is a plain string ``"12+7="``; if True it is a
            one-message conversation ``[{"role": "user", "content": "12+7="}]``.
        max_operand: operands are drawn from ``0..max_operand``.

    ``answer`` is always the exact sum as a string, e.g. ``"19"``.
    """
    problems = sample_problems(num_rows, seed=seed, max_operand=max_operand)
    texts = [format_problem(a, b) for a, b in problems]
    prompts: list[Any] = [[{"role": "user", "content": t}] for t in texts] if conversational else texts
    return Dataset.from_dict({"prompt": prompts, "answer": [str(a + b) for a, b in problems]})
