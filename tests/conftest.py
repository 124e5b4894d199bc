"""Shared fixtures: tiny locally built models (no hub access) and a scripted generation backend."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random ~90k-parameter Qwen2 with the demo tokenizer (byte-level BPE, ChatML template)."""
    from grouprl.demo.model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def long_context_model_dir(tmp_path_factory):
    """The same tiny model with room for TRL's default max_completion_length (512)."""
    from grouprl.demo.model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_long") / "model", seed=0, max_position_embeddings=1024)
