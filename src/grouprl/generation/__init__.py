"""Generation backends behind one protocol (`protocol.GenerationBackend`)."""

from .hf import TransformersGenerator
from .protocol import GenerationBackend

__all__ = ["GenerationBackend", "TransformersGenerator"]
