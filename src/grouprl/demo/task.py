"""A procedural arithmetic task with a verifiable reward.

Prompts are two-operand additions such as ``"12+7="``; the answer is the sum as a string (``"19"``).
The task is small enough for a ~0.5M-parameter model yet has a crisp, programmatic reward, which is
exactly what a GRPO demo needs: no reward model, no labels beyond the sum itself.
"""

from __future__ import annotations

import random
import re
from typing import Any

from datasets import Dataset

MAX_OPERAND = 49
"""Operands are drawn uniformly from ``0..MAX_OPERAND`` (sums range over 0..98)."""

_LEADING_INT = re.compile(r"[+-]?\d+")


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


def _completion_text(completion: Any) -> str:
    """Text of one completion: a string (standard format) or a list of messages (conversational),
    in which case the assistant's content is used (the last message's content if no role matches)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    messages = list(completion)
    assistant = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    chosen = assistant or messages
    return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in chosen)


def parse_answer(text: str) -> int | None:
    """The leading integer of ``text`` after stripping whitespace, or None if it does not start
    with one (``"19<eos>"`` -> 19, ``" 19 apples"`` -> 19, ``"nineteen"`` -> None)."""
    match = _LEADING_INT.match(text.strip())
    return int(match.group()) if match else None


def arithmetic_reward(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 where a completion's leading integer equals the row's answer, else 0.0.

    Follows the TRL reward-function convention: ``completions`` holds one entry per sample (a string
    or a list of ``{"role", "content"}`` messages), every dataset column arrives as a keyword list
    aligned with it (here ``answer``), and anything else the trainer passes (``prompts``,
    ``completion_ids``, ``trainer_state``, ...) is accepted and ignored.
    """
    del kwargs  # extra columns / trainer context are not needed for this reward
    rewards = []
    for completion, target in zip(completions, answer, strict=True):
        predicted = parse_answer(_completion_text(completion))
        rewards.append(1.0 if predicted is not None and predicted == int(target) else 0.0)
    return rewards
