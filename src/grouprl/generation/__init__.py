"""Generation backends behind one protocol (`protocol.GenerationBackend`)."""

from grouprl.generation.engine import FastGenerator
from grouprl.generation.hf import TransformersGenerator
from grouprl.generation.protocol import GenerationBackend
from grouprl.generation.remote import RemoteGenerator, ServerError
from grouprl.generation.vllm import VLLMColocateGenerator, VLLMServerGenerator

__all__ = [
    "FastGenerator",
    "GenerationBackend",
    "RemoteGenerator",
    "ServerError",
    "TransformersGenerator",
    "VLLMColocateGenerator",
    "VLLMServerGenerator",
]
