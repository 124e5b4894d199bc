"""Prefix-preserving training templates for model families whose own chat template is not.

Tool-calling rollouts append the template's text for tool results after the sampled tokens (chat.py),
which needs the template to render a tool-calling assistant turn the same whether or not tool messages
follow it. Qwen3's template does not: it gives a reasoning-free turn an empty <think></think> block
while it is the last message and drops it once tools answer. For such families grouprl carries its own
training template (chat_templates/*.jinja, written here) that renders prompts exactly as the original
and is prefix-preserving; it is used for the tool-result suffixes only, so prompts still go through the
tokenizer's own template and a saved tokenizer keeps it.

A family is recognised by the exact text of its original template (a SHA-256 of it, surrounding
whitespace ignored), not by a pattern: the training template was checked against that text and only
that text, so an edited or newer revision of the template is refused by name rather than trained on
with a template that may render it differently.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any, Optional


@dataclass(frozen=True)
class TrainingTemplate:
    family: str  # the model family, as logged
    flaw: str  # what the original does once tool results follow a turn, as logged
    filename: str  # under grouprl/agents/chat_templates/
    originals: frozenset[str]  # SHA-256 of each original template text (stripped) it stands in for

    @cached_property
    def text(self) -> str:
        return resources.files(__package__).joinpath("chat_templates", self.filename).read_text(encoding="utf-8")

    @property
    def path(self) -> str:
        return f"grouprl/agents/chat_templates/{self.filename}"


def template_digest(chat_template: str) -> str:
    return hashlib.sha256(chat_template.strip().encode("utf-8")).hexdigest()


TRAINING_TEMPLATES = (
    TrainingTemplate(
        family="Qwen3",
        flaw=(
            "it drops the empty <think></think> block of a reasoning-free tool-calling turn once tool results follow it"
        ),
        filename="qwen3_training.jinja",
        # Qwen3's hybrid-thinking template (the enable_thinking flag), as carried by
        # trl-internal-testing/tiny-Qwen3ForCausalLM; TRL 1.16 recognises the same
        # text (its chat_templates/qwen3.jinja).
        originals=frozenset({"a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"}),
    ),
)


def training_template_for(chat_template: Any) -> Optional[TrainingTemplate]:
    """The training template standing in for this exact original template, or None if grouprl has none."""
    if not isinstance(chat_template, str):
        return None
    digest = template_digest(chat_template)
    return next((t for t in TRAINING_TEMPLATES if digest in t.originals), None)


def known_families() -> str:
    return ", ".join(t.family for t in TRAINING_TEMPLATES)
