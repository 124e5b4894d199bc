"""Generation backends behind one protocol (`protocol.GenerationBackend`)."""

from .engine import FastGenerator
from .hf import TransformersGenerator
from .protocol import GenerationBackend
from .remote import RemoteGenerator, ServerError
from .vllm import VLLMColocateGenerator, VLLMServerGenerator

__all__ = ["FastGenerator", "GenerationBackend", "RemoteGenerator", "ServerError", "TransformersGenerator", "VLLMColocateGenerator",
           "VLLMServerGenerator"]
