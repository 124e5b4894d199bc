"""Generation backends behind one protocol (`protocol.GenerationBackend`)."""

from .engine import FastGenerator
from .hf import TransformersGenerator
from .protocol import GenerationBackend

__all__ = ["FastGenerator", "GenerationBackend", "TransformersGenerator"]
