"""Honouring a `model.generate` the user replaced.

grouprl's fast engine (engine.py) samples with forward passes and never calls `model.generate`.
TRL always samples through it, so TRL scripts that override or patch `generate` (a subclass
with its own `generate`, `model.generate = ...`, `unittest.mock.patch` of
`GenerationMixin.generate` to script completions) expect their version to run. Skipping it
silently would train on different completions than the script asked for, so:

* generation_engine='auto' samples with the engine while `generate` is transformers' own and
  with transformers `generate` (hf.py) whenever it is not; this is checked at every generation,
  because a patch may be applied after the trainer is built;
* generation_engine='engine' or 'captured' refuses, naming what replaced `generate`.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from grouprl.core.types import Completion, SamplingParams
from grouprl.generation.engine import FastGenerator
from grouprl.generation.hf import TransformersGenerator

logger = logging.get_logger("grouprl")

# Captured when grouprl is imported, before a test or script patches the class attribute.
STOCK_GENERATE = inspect.getattr_static(GenerationMixin, "generate")


def generate_override(model: torch.nn.Module) -> Optional[str]:
    """None if `model.generate` runs transformers' GenerationMixin.generate; else what replaced it, in words."""
    if "generate" in vars(model):
        return f"generate is set on the {type(model).__name__} instance"
    owner = next((c for c in type(model).__mro__ if "generate" in vars(c)), None)
    if owner is None:
        return None  # no generate at all: nothing the engine could bypass
    if owner is GenerationMixin:
        current = vars(GenerationMixin)["generate"]
        if current is STOCK_GENERATE and getattr(current, "__module__", "").startswith("transformers."):
            return None
        return "transformers' GenerationMixin.generate is patched"
    if owner.__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        return generate_override(model.get_base_model())  # a PeftModel's generate calls its base model's
    return f"{owner.__qualname__} overrides generate"


class EngineUnlessGenerateOverridden:
    """The fast engine, or, while `model.generate` is not transformers' own, transformers `generate`.

    With `fallback=None` (generation_engine='engine') an overridden `generate` is an error instead.
    """

    needs_importance_correction = False  # both sample from the training weights in this process

    def __init__(self, engine: FastGenerator, fallback: Optional[TransformersGenerator], name: str = "engine"):
        self.engine, self.name = engine, name  # name: the generation_engine value that chose it
        self.fallback = fallback
        self._announced: Optional[str] = None

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)
        if self.fallback is not None:
            self.fallback.sync_weights(model)

    def check(self) -> Optional[str]:
        """What replaced `generate` (None: nothing); raises under generation_engine='engine'."""
        reason = generate_override(self.engine.model)
        if reason is not None and self.fallback is None:
            raise ValueError(
                f"GRPOConfig.generation_engine={self.name!r} samples without calling model.generate, but {reason}, so "
                "that code would never run. Use generation_engine='auto' (it then samples with model.generate) or "
                "'transformers'."
            )
        return reason

    def generate(self, prompt_ids: list[list[int]], num_samples: int, params: SamplingParams) -> list[Completion]:
        reason = self.check()
        if reason is None:
            return self.engine.generate(prompt_ids, num_samples, params)
        if reason != self._announced:
            logger.warning(
                f"grouprl: {reason}; sampling calls model.generate (transformers) instead of grouprl's engine, "
                "which would bypass it."
            )
            self._announced = reason
        return self.fallback.generate(prompt_ids, num_samples, params)
