"""The demo task's verifiable reward: the completion's leading integer against the row's ``answer``.

A rewards-layer module (``grouprl train --reward_funcs arithmetic_reward`` names it), so the rewards
package never imports the demo; the demo's task re-exports it.
"""

from __future__ import annotations

import re
from typing import Any

_LEADING_INT = re.compile(r"[+-]?\d+")


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
