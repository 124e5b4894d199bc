"""Ready-made reward functions with TRL's names and semantics (``trl.rewards``).

- ``accuracy_reward``: 1.0 if the completion's answer equals the ``solution`` column under
  math-verify (symbolic comparison of LaTeX / plain expressions, ``\\boxed{}`` tried first), else 0.0;
  ``None`` when the gold solution itself cannot be parsed (the row is skipped, not punished).
- ``reasoning_accuracy_reward``: the same, on the text after the last reasoning delimiter
  (default ``</think>``); 0.0 when no delimiter closes the reasoning.
- ``think_format_reward``: 1.0 if the completion opens with exactly one ``<think>...</think>`` block.
- ``get_cosine_scaled_reward(max_len)``: correctness scaled by a cosine length schedule
  ("Demystifying Long Chain-of-Thought Reasoning", arXiv 2502.03373, App. C.1).
- ``get_repetition_penalty_reward(ngram_size, max_penalty)``: penalty for repeated token n-grams
  (same paper, App. C.2).
- ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``: DAPO's soft length
  penalty (arXiv 2503.14476, eq. 13).

Completions may be plain strings or conversational message lists (the text of the first message
is scored, as in TRL). Factories return small classes, not closures, so every reward pickles (for
worker processes) and keeps TRL's metric name through a fixed ``__name__``.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable, Optional, Sequence

MATH_VERIFY_HINT = "pip install 'grouprl[math]' (or: pip install math-verify)"


def _text(completion: Any) -> str:
    """The text of a completion: a string, or the content of the first message of a conversation."""
    if isinstance(completion, str):
        return completion
    return completion[0]["content"]


def _math_verify() -> tuple[Any, Any, Any, Any]:
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as err:
        raise ImportError(f"accuracy rewards need the math-verify package: {MATH_VERIFY_HINT}") from err
    return NormalizationConfig, LatexExtractionConfig, parse, verify


class _MathChecker:
    """Parses gold solutions and answers with math-verify and compares them.

    math-verify enforces its timeouts with ``signal.alarm``, which only works in the main thread;
    elsewhere (grouprl runs several sync reward functions in worker threads) they are disabled.
    """

    def __init__(self) -> None:
        normalization, extraction, self.parse, self.verify = _math_verify()
        self.answer_config = [
            extraction(
                normalization_config=normalization(
                    basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all", equations=False
                ),
                boxed_match_priority=0,  # \boxed{...} first
                try_extract_without_anchor=False,  # an answer must be marked, not any number in the text
            )
        ]
        main = threading.current_thread() is threading.main_thread()
        self.parse_timeout = 10 if main else None
        self.verify_timeout = 5 if main else None
        if not main:
            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).setLevel(logging.ERROR)  # "timeout disabled" warnings, once per call

    def check(self, answer_text: str, solution: str) -> tuple[Optional[float], str, str]:
        """(reward or None, gold as parsed, answer as parsed) for one completion."""
        gold = self.parse(solution, parsing_timeout=self.parse_timeout)
        if len(gold) == 0:
            return None, "[unparseable]", "[skipped]"
        answer = self.parse(
            answer_text,
            extraction_config=self.answer_config,
            extraction_mode="first_match",
            parsing_timeout=self.parse_timeout,
        )
        correct = self.verify(gold, answer, timeout_seconds=self.verify_timeout)
        return float(correct), str(gold), str(answer) if answer else "[unparseable]"


def _check_all(
    texts: Sequence[Optional[str]], solution: Sequence[str], log_extra: Optional[Callable]
) -> list[Optional[float]]:
    """Score answer texts (None = reasoning never closed: 0.0) and log the parses as extra columns."""
    if len(texts) != len(solution):
        raise ValueError(f"got {len(texts)} completions but {len(solution)} solutions")
    checker = _MathChecker()
    rewards, gold_column, answer_column = [], [], []
    for text, gold in zip(texts, solution):
        if text is None:
            reward, gold_parsed, answer_parsed = 0.0, "[incomplete reasoning]", "[incomplete reasoning]"
        else:
            reward, gold_parsed, answer_parsed = checker.check(text, gold)
        rewards.append(reward)
        gold_column.append(gold_parsed)
        answer_column.append(answer_parsed)
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", gold_column)
        log_extra("answer_parsed", answer_column)
    return rewards


def accuracy_reward(
    completions: list, solution: list[str], log_extra: Optional[Callable] = None, **kwargs: Any
) -> list[Optional[float]]:
    r"""1.0 if the completion's answer matches ``solution`` (math-verify), 0.0 if not, None if the gold is unparseable.

    >>> accuracy_reward([r"My answer is \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"], [r"\frac{1}{3}", r"\frac{1}{3}"])
    [1.0, 0.0]
    """
    return _check_all([_text(c) for c in completions], solution, log_extra)


def reasoning_accuracy_reward(
    completions: list,
    solution: list[str],
    reasoning_delimiters: Optional[list[str]] = None,
    log_extra: Optional[Callable] = None,
    **kwargs: Any,
) -> list[Optional[float]]:
    """accuracy_reward on the text after the reasoning: after the last occurrence of the first
    delimiter (default ``</think>``) found in the completion. No delimiter: 0.0 (unfinished
    reasoning is penalised, not skipped). An answer given only inside the reasoning scores 0.0."""
    delimiters = reasoning_delimiters if reasoning_delimiters is not None else ["</think>"]
    answers: list[Optional[str]] = []
    for completion in completions:
        text = _text(completion)
        found = next((d for d in delimiters if d in text), None)
        answers.append(None if found is None else text.rsplit(found, 1)[-1])
    return _check_all(answers, solution, log_extra)


def think_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 if the completion starts with ``<think>``, has no second ``<think>``, and closes it with ``</think>``."""
    rewards = []
    for completion in completions:
        text = _text(completion)
        body = text[len("<think>") :] if text.startswith("<think>") else None
        rewards.append(1.0 if body is not None and "<think>" not in body and "</think>" in body else 0.0)
    return rewards


class CosineScaledReward:
    """See :func:`get_cosine_scaled_reward`."""

    __name__ = "cosine_scaled_reward"

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float,
        max_value_wrong: float,
        min_value_correct: float,
        max_value_correct: float,
    ):
        if max_len <= 0:
            raise ValueError(f"get_cosine_scaled_reward: max_len must be > 0, got {max_len}")
        self.max_len = max_len
        self.min_value_wrong, self.max_value_wrong = min_value_wrong, max_value_wrong
        self.min_value_correct, self.max_value_correct = min_value_correct, max_value_correct

    def __call__(
        self, completions: list, solution: list[str], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[Optional[float]]:
        correctness = accuracy_reward(completions, solution)
        rewards: list[Optional[float]] = []
        for correct, ids in zip(correctness, completion_ids):
            if correct is None:
                rewards.append(None)
                continue
            # Past max_len the schedule stays at its long end (cos is periodic and would climb back).
            cosine = math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)
            if correct:  # short and right: max_value_correct; long and right: min_value_correct
                short_end, long_end = self.max_value_correct, self.min_value_correct
            else:  # short and wrong: min_value_wrong (worst); long and wrong: max_value_wrong
                short_end, long_end = self.min_value_wrong, self.max_value_wrong
            rewards.append(long_end + 0.5 * (short_end - long_end) * (1.0 + cosine))
        return rewards


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> CosineScaledReward:
    """Correctness (as accuracy_reward) scaled by length L = len(completion_ids) on a cosine schedule:
    r = v_long + (v_short - v_long) * (1 + cos(pi * min(L / max_len, 1))) / 2. Correct answers earn
    more when short (1.0 -> 0.5), wrong ones are punished less when long (-1.0 -> -0.5), so
    exploration is not discouraged. None where the gold solution is unparseable."""
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class RepetitionPenalty:
    """See :func:`get_repetition_penalty_reward`."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        if ngram_size <= 0:
            raise ValueError(f"get_repetition_penalty_reward: ngram_size must be > 0, got {ngram_size}")
        if max_penalty > 0:
            raise ValueError(
                f"get_repetition_penalty_reward: max_penalty {max_penalty} must not be positive (it is a penalty)"
            )
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        rewards = []
        for ids in completion_ids:
            count = len(ids) - self.ngram_size + 1
            if count <= 0:
                rewards.append(0.0)
                continue
            distinct = len({tuple(ids[i : i + self.ngram_size]) for i in range(count)})
            repeated = 1.0 - distinct / count
            rewards.append(repeated * self.max_penalty if repeated else 0.0)
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    """Penalty (1 - distinct/total token n-grams) * max_penalty, in [max_penalty, 0]; 0 for
    completions shorter than ngram_size tokens."""
    return RepetitionPenalty(ngram_size, max_penalty)


class SoftOverlongPunishment:
    """See :func:`get_soft_overlong_punishment`."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if soft_punish_cache < 0 or soft_punish_cache > max_completion_len:
            raise ValueError(
                f"get_soft_overlong_punishment: soft_punish_cache={soft_punish_cache} must be in [0, "
                f"max_completion_len={max_completion_len}]"
            )
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        start = self.max_completion_len - self.soft_punish_cache  # punishment starts above this length
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= start:
                rewards.append(0.0)
            elif length <= self.max_completion_len:
                rewards.append((start - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """DAPO eq. 13: 0 up to L_max - L_cache tokens, then linearly down to -1 at L_max, -1 beyond."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)
