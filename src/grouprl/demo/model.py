"""Tiny Qwen2 models for tests and the GRPO demo.

* :func:`save_tiny_model` writes a *randomly initialised* tiny model + tokenizer to a folder, for
  fast end-to-end tests of the trainer (it loads like any Hub checkpoint).
* ``DEMO_MODEL_DIR`` (``grouprl/demo/tiny_arith``) is the committed demo checkpoint, built from
  this module's model by the recipe in :mod:`grouprl.demo.pretrain` and measured by
  :mod:`grouprl.demo.evaluation`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from grouprl.demo.tokenizer import EOS_TOKEN, IM_END, build_tokenizer

DEMO_MODEL_DIR = Path(__file__).parent / "tiny_arith"


def tiny_qwen2_config(
    tokenizer: PreTrainedTokenizerBase,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
) -> Qwen2Config:
    """A Qwen2 config sized for CPU tests, with vocabulary and special ids taken from ``tokenizer``.

    The tokenizer has no bos token; like the real Qwen2 configs, ``bos_token_id`` is set to the
    ``<|endoftext|>`` id (it is never prepended to inputs).
    """
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=eos_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        use_cache=True,
    )


def demo_generation_config(tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """Generation defaults: stop at ``<|endoftext|>`` (plain-text prompts) *or* ``<|im_end|>``
    (end of an assistant turn in ChatML), pad with ``<|endoftext|>``."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=[eos_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase | None = None, seed: int = 0, **config_overrides: Any
) -> Qwen2ForCausalLM:
    """A randomly initialised float32 Qwen2ForCausalLM; the same seed gives the same weights.

    ``config_overrides`` are forwarded to :func:`tiny_qwen2_config` (e.g. ``hidden_size=128``).
    """
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    config = tiny_qwen2_config(tokenizer, **config_overrides)
    # Fork the RNG so building a model does not reseed the caller's global torch state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = demo_generation_config(tokenizer)
    return model


def save_tiny_model(path: str | Path, seed: int = 0, **config_overrides: Any) -> str:
    """Write a random tiny model, its tokenizer and generation config to ``path``.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``. Returns ``str(path)``.
    """
    path = Path(path)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **config_overrides)
    save_model(model, tokenizer, path)
    return str(path)


def save_model(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """Write the model, its tokenizer and generation config to ``path`` (a folder, created if needed)."""
    path.mkdir(parents=True, exist_ok=True)
    # Let the tokenizer know the model's context size (trainers read it to truncate prompts).
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(path)  # config.json, model.safetensors, generation_config.json
    tokenizer.save_pretrained(path)
