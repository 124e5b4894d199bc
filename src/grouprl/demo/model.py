"""Tiny Qwen2 models for tests and the GRPO demo, plus the recipe of the committed checkpoint.

Two uses:

* :func:`save_tiny_model` writes a *randomly initialised* tiny model + tokenizer to a folder, for
  fast end-to-end tests of the trainer (it loads like any Hub checkpoint).
* :func:`pretrain_demo_model` produces ``grouprl/demo/tiny_arith``: a small model supervised on
  *noisy* arithmetic. It learns the answer format and puts real but not dominant probability on the
  correct sum, so GRPO with :func:`grouprl.demo.task.arithmetic_reward` has a clear signal to
  amplify and visibly raises the sampled accuracy within a few minutes on a CPU.

Regenerate the checkpoint with ``python -m grouprl.demo.model --regenerate``.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from grouprl.demo.task import MAX_OPERAND, arithmetic_reward, format_problem, make_arithmetic_dataset
from grouprl.demo.tokenizer import EOS_TOKEN, IM_END, build_tokenizer

DEMO_MODEL_DIR = Path(__file__).parent / "tiny_arith"

# Architecture of the committed demo checkpoint (~0.2M parameters; the defaults of
# tiny_qwen2_config are smaller still and meant for tests). Chosen so that pretraining takes a few
# minutes and a GRPO step is cheap on 2 CPU cores, while the model is still able to learn
# two-digit addition (with its noisy answer distribution) within that budget.
DEMO_ARCH: dict[str, int] = {
    "hidden_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 192,
}
CORRECT_PROB = 0.4
"""In the pretraining data the shown answer is correct with this probability, else off by 1..3."""
HELDOUT_SEED = 1234
"""Seed of the evaluation rows (pretraining draws its problems from a differently seeded RNG).

With only 50 x 50 possible problems the pretraining stream covers all of them, so "held-out" means
independently drawn rows and noise-free answers, not unseen problems."""


# --------------------------------------------------------------------------------------------------
# Model construction
# --------------------------------------------------------------------------------------------------


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
    _save(model, tokenizer, path)
    return str(path)


def _save(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # Let the tokenizer know the model's context size (trainers read it to truncate prompts).
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(path)  # config.json, model.safetensors, generation_config.json
    tokenizer.save_pretrained(path)


# --------------------------------------------------------------------------------------------------
# Pretraining (supervised, on deliberately noisy answers)
# --------------------------------------------------------------------------------------------------


def noisy_answer(a: int, b: int, rng: random.Random, correct_prob: float = CORRECT_PROB) -> int:
    """The correct sum with probability ``correct_prob``, otherwise the sum shifted by +-1..3.

    Wrong answers stay non-negative (a negative shift that would cross zero is flipped), so every
    training answer is a plain digit string.
    """
    total = a + b
    if rng.random() < correct_prob:
        return total
    shift = rng.choice((-3, -2, -1, 1, 2, 3))
    return total + shift if total + shift >= 0 else total - shift


class _ExampleEncoder:
    """Token ids of prompts and targets, cached because the problem space is tiny (50 x 50)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        self.im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        self._cache: dict[tuple[Any, ...], list[int]] = {}

    def _ids(self, key: tuple[Any, ...], text: str) -> list[int]:
        if key not in self._cache:
            self._cache[key] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._cache[key]

    def encode(self, a: int, b: int, answer: int, conversational: bool) -> tuple[list[int], list[int]]:
        """(prompt ids, target ids). The target is the answer digits followed by the stop token
        the model must learn for this format: ``<|endoftext|>`` or ``<|im_end|>``."""
        problem = format_problem(a, b)
        if conversational:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": problem}], add_generation_prompt=True, tokenize=False
            )
            prompt, stop = self._ids(("chat", a, b), text), self.im_end_id
        else:
            prompt, stop = self._ids(("plain", a, b), problem), self.eos_id
        return prompt, self._ids(("answer", answer), str(answer)) + [stop]


def _collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (prompt + target) sequences; labels are -100 except on the target tokens, so the
    loss teaches only *what to answer and when to stop*, not how to write prompts."""
    length = max(len(p) + len(t) for p, t in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (prompt, target) in enumerate(examples):
        ids = prompt + target
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(prompt) : len(ids)] = torch.tensor(target)
        attention_mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _sample_batch(
    encoder: _ExampleEncoder, rng: random.Random, batch_size: int, correct_prob: float
) -> dict[str, torch.Tensor]:
    """A fresh batch: random problems, noisy answers, each rendered plain or ChatML with prob 1/2."""
    examples = []
    for _ in range(batch_size):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        answer = noisy_answer(a, b, rng, correct_prob)
        examples.append(encoder.encode(a, b, answer, conversational=rng.random() < 0.5))
    return _collate(examples, encoder.tokenizer.pad_token_id)


def pretrain_demo_model(
    output_dir: str | Path = DEMO_MODEL_DIR,
    steps: int = 3000,
    seed: int = 0,
    batch_size: int = 128,
    learning_rate: float = 3e-3,
    correct_prob: float = CORRECT_PROB,
    log_every: int = 250,
) -> None:
    """Supervised next-token training of the demo model; writes the checkpoint to ``output_dir``.

    Every example is a fresh random problem ``a+b=`` with a *noisy* answer (see
    :func:`noisy_answer`), rendered half of the time as plain text (``"a+b=" + answer +
    "<|endoftext|>"``) and half of the time as a ChatML conversation whose assistant turn is the
    answer followed by ``<|im_end|>``. Deterministic for a given seed.
    """
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **DEMO_ARCH)
    encoder = _ExampleEncoder(tokenizer)
    rng = random.Random(seed)  # problems, noise and formats; independent of HELDOUT_SEED rows

    # AdamW with a short warmup then cosine decay to 10%: converges fast on this tiny problem.
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    # Logits of the ~250 byte tokens that never occur in the data are pushed towards -inf, so their
    # (tied) embedding gradients and Adam second moments underflow into denormal floats, which are
    # orders of magnitude slower on CPUs. Flushing them to zero keeps every step equally fast.
    flush_ok = torch.set_flush_denormal(True)
    try:
        # Nothing in a step draws from torch's RNG today (no dropout); seeding anyway keeps the recipe
        # deterministic if that changes, and fork_rng leaves the caller's RNG state alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model.train()
            running, start = 0.0, time.perf_counter()
            for step in range(steps):
                batch = _sample_batch(encoder, rng, batch_size, correct_prob)
                loss = model(**batch).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                running += loss.item()
                if log_every and (step + 1) % log_every == 0:
                    print(
                        f"step {step + 1}/{steps}  loss {running / log_every:.4f}  "
                        f"lr {scheduler.get_last_lr()[0]:.2e}  {time.perf_counter() - start:.0f}s",
                        flush=True,
                    )
                    running = 0.0
    finally:
        if flush_ok:
            torch.set_flush_denormal(False)  # back to the default for the rest of the process
    model.eval()
    _save(model, tokenizer, Path(output_dir))


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regenerate", action="store_true", help="retrain the committed demo checkpoint")
    parser.add_argument("--output-dir", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.regenerate:
        start = time.perf_counter()
        pretrain_demo_model(args.output_dir, steps=args.steps, seed=args.seed)
        print(f"pretraining took {time.perf_counter() - start:.1f}s; saved to {args.output_dir}")
    for key, value in evaluate_demo_model(args.output_dir).items():
        print(f"{key}: {value:.3f}")


if __name__ == "__main__":
    main()
