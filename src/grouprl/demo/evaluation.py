"""Held-out metrics of a demo model: sampled and greedy accuracy on arithmetic, and the stop rate."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from grouprl.demo.model import DEMO_MODEL_DIR
from grouprl.demo.task import arithmetic_reward, make_arithmetic_dataset

HELDOUT_SEED = 1234
"""Seed of the evaluation rows (pretraining draws its problems from a differently seeded RNG).

With only 50 x 50 possible problems the pretraining stream covers all of them, so "held-out" means
independently drawn rows and noise-free answers, not unseen problems."""


def _prompt_texts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Any]) -> tuple[list[str], bool]:
    """Render dataset prompts to text; conversational prompts go through the chat template."""
    conversational = not isinstance(prompts[0], str)
    if not conversational:
        return list(prompts), False
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    return texts, True


@torch.no_grad()
def generate_completions(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Any],
    do_sample: bool,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> tuple[list[Any], list[bool]]:
    """Generate one completion per prompt. Returns (completions, stopped) where completions are
    strings, or ``[{"role": "assistant", "content": ...}]`` for conversational prompts (the shape
    reward functions receive), and ``stopped[i]`` says whether the model emitted a stop token."""
    texts, conversational = _prompt_texts(tokenizer, prompts)
    eos = model.generation_config.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
    # Pass every sampling knob explicitly so the result does not depend on generation_config defaults
    # (transformers otherwise applies top_k=50); greedy decoding resets them to "unset".
    if do_sample:
        decoding = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    else:
        decoding = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    completions: list[Any] = []
    stopped: list[bool] = []
    model.eval()
    for start in range(0, len(texts), batch_size):
        # Left padding keeps every prompt flush against its first generated token.
        enc = tokenizer(
            texts[start : start + batch_size],
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        ).to(model.device)
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **decoding,
        )
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            stop_at = next((i for i, token in enumerate(row) if token in stop_ids), None)
            stopped.append(stop_at is not None)
            text = tokenizer.decode(row[:stop_at], skip_special_tokens=True)
            completions.append([{"role": "assistant", "content": text}] if conversational else text)
    return completions, stopped


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch for a block and restore the caller's RNG state afterwards (CPU, and the CUDA
    device the model is on), so evaluations are reproducible without side effects."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def sampled_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Any,
    num_samples: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    seed: int = 0,
) -> float:
    """Fraction of sampled completions (``num_samples`` per prompt, multinomial sampling at
    ``temperature``) that :func:`arithmetic_reward` scores 1. Seeded; the caller's global torch RNG
    state is left untouched."""
    prompts = [p for p in dataset["prompt"] for _ in range(num_samples)]
    answers = [a for a in dataset["answer"] for _ in range(num_samples)]
    with _seeded(seed, model.device):
        completions, _ = generate_completions(
            model, tokenizer, prompts, do_sample=True, temperature=temperature, max_new_tokens=max_new_tokens
        )
    rewards = arithmetic_reward(completions, answers)
    return sum(rewards) / len(rewards)


def greedy_accuracy(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, dataset: Any, max_new_tokens: int = 8
) -> float:
    """Fraction of prompts whose greedy (argmax) completion :func:`arithmetic_reward` scores 1."""
    completions, _ = generate_completions(
        model, tokenizer, dataset["prompt"], do_sample=False, max_new_tokens=max_new_tokens
    )
    rewards = arithmetic_reward(completions, dataset["answer"])
    return sum(rewards) / len(rewards)


def stop_rate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Any,
    seed: int = 0,
    max_new_tokens: int = 8,
) -> float:
    """Fraction of sampled completions that end with a stop token within ``max_new_tokens`` (a
    format check: the model should answer a number and stop)."""
    with _seeded(seed, model.device):
        _, stopped = generate_completions(
            model, tokenizer, dataset["prompt"], do_sample=True, max_new_tokens=max_new_tokens
        )
    return sum(stopped) / len(stopped)


def evaluate_demo_model(
    path: str | Path = DEMO_MODEL_DIR, num_rows: int = 256, num_samples: int = 4
) -> dict[str, float]:
    """Held-out metrics of a checkpoint, for both prompt formats (rows seeded with HELDOUT_SEED)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    metrics: dict[str, float] = {}
    for name, conversational in (("standard", False), ("conversational", True)):
        data = make_arithmetic_dataset(num_rows, seed=HELDOUT_SEED, conversational=conversational)
        metrics[f"{name}/sampled_accuracy"] = sampled_accuracy(model, tokenizer, data, num_samples=num_samples)
        metrics[f"{name}/greedy_accuracy"] = greedy_accuracy(model, tokenizer, data)
        metrics[f"{name}/stop_rate"] = stop_rate(model, tokenizer, data)
    return metrics
