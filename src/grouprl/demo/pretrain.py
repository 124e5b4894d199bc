"""The recipe of the committed demo checkpoint: a tiny model supervised on *noisy* arithmetic.

:func:`pretrain_demo_model` produces ``grouprl/demo/tiny_arith``. The model learns the answer
format and puts real but not dominant probability on the correct sum, so GRPO with
:func:`grouprl.demo.task.arithmetic_reward` has a clear signal to amplify and visibly raises the
sampled accuracy within a few minutes on a CPU.

Regenerate the checkpoint with ``python -m grouprl.demo.pretrain --regenerate``.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from grouprl.demo.evaluation import evaluate_demo_model
from grouprl.demo.model import DEMO_MODEL_DIR, build_tiny_model, save_model
from grouprl.demo.task import MAX_OPERAND, format_problem
from grouprl.demo.tokenizer import EOS_TOKEN, IM_END, build_tokenizer

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
    save_model(model, tokenizer, Path(output_dir))


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
