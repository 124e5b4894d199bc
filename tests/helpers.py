"""Test helpers: a deterministic generation backend and small comparison utilities."""

import contextlib
import os
from typing import Callable, Iterator

import torch

from grouprl.core.types import Completion, SamplingParams


class ScriptedBackend:
    """Returns completions decided by `script(prompt_ids, sample_index) -> token ids` (EOS included or not).

    Lets tests inject the same completions into differently configured runs, so sampling noise
    cannot hide a bug.
    """

    def __init__(
        self, script: Callable[[list[int], int], list[int]], eos_token_id: int, tokenizer=None, sampler_logprobs=None
    ):
        self.script, self.eos, self.tokenizer = script, eos_token_id, tokenizer
        self.sampler_logprobs = sampler_logprobs  # optional (prompt_ids, sample_index, tokens) -> one logprob per token
        self.calls = []

    def sync_weights(self, model):
        pass

    def generate(self, prompt_ids, num_samples, params: SamplingParams):
        self.calls.append((list(map(list, prompt_ids)), num_samples))
        out = []
        for p, ids in enumerate(prompt_ids):
            for s in range(num_samples):
                tokens = list(self.script(list(ids), s))[: params.max_new_tokens]
                text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else ""
                logprobs = self.sampler_logprobs(list(ids), s, tokens) if self.sampler_logprobs else None
                out.append(
                    Completion(p, tokens, text, "stop" if tokens and tokens[-1] == self.eos else "length", logprobs)
                )
        return out


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


class GradientRecorder(torch.optim.SGD):
    """SGD with lr=0 that records every optimizer step's gradients: all steps see the same weights,
    so the gradients of several steps can be compared with one bigger step's."""

    def __init__(self, params):
        self.named = list(params)
        super().__init__([p for _, p in self.named], lr=0.0)
        self.steps = []

    def step(self, closure=None):
        self.steps.append({name: p.grad.detach().clone() for name, p in self.named if p.grad is not None})
        return super().step(closure)


def distinct_tokens(completion_ids, **kwargs) -> list[float]:
    """A reward with signal on a random model: the number of distinct tokens in each completion."""
    return [float(len(set(ids))) for ids in completion_ids]


def sample_through_the_backend(prompts, trainer) -> dict:
    """A rollout_func (TRL's contract) that samples one completion per entry through trainer.generation_backend, with
    the sampler's logprobs (None where the backend gives none)."""
    ids = [trainer.processing_class(prompt)["input_ids"] for prompt in prompts]
    completions = trainer.generation_backend.generate(ids, 1, trainer.run.rollouts.sampling)
    return {
        "prompt_ids": ids,
        "completion_ids": [c.token_ids for c in completions],
        "logprobs": [c.sampler_logprobs for c in completions],
    }


# the tool of the tool-calling tests (test_agents, the distributed worker): its docstring is its schema
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def look(index: int) -> list:
    """Show a picture.

    Args:
        index: which picture
    """
    from vlm_models import image  # beside this module

    return [{"type": "image", "image": image(100 + index % 5)}, {"type": "text", "text": f"picture {index}"}]


class Counter:
    """An environment whose tool adds to a count (the distributed worker's and the vLLM runner's
    environment_factory)."""

    def reset(self, **row):
        self.count = 0

    def increment(self, step: int) -> int:
        """Add to the count.

        Args:
            step: how much to add
        """
        self.count += step
        return self.count


def odd_prompts_tie(prompts, completion_ids, **kwargs) -> list[float]:
    """distinct_tokens for the prompts "i+j=" of an even i, 1 for every completion of the others: their groups tie, so
    dynamic sampling drops them and draws again."""
    return [1.0 if int(p.split("+")[0]) % 2 else float(len(set(ids))) for p, ids in zip(prompts, completion_ids)]


def numbered_prompts(n: int = 12):
    """`n` standard prompts "i+(i % 5)=" as a datasets.Dataset."""
    import datasets

    return datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(n)]})


def quiet_config(tmp_path, overrides=None, **defaults):
    """A GRPOConfig for short test runs: output under tmp_path, G=3, a log entry every step, no checkpoints, no
    trackers or progress bar, seed 0; `defaults` are a test file's own sizes, `overrides` (a dict) a test's changes."""
    from grouprl import GRPOConfig

    base = dict(
        output_dir=str(tmp_path / "out"),
        num_generations=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    return GRPOConfig(**{**base, **defaults, **(overrides or {})})


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux: /proc/self/task), sorted."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as comm:
                names.append(comm.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(name for name in names if "gloo" in name)


def cpu_parameters(model) -> dict[str, torch.Tensor]:
    """`parameters(model)` copied to the CPU: for comparing a trainer's model, on whatever device the trainer picked,
    with a model or checkpoint loaded on the CPU (values unchanged)."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}


def forward_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> torch.Tensor:
    """One completion's per-token logprobs under `temperature` from a separate forward pass over prompt + completion
    (on the model's device; returned on the CPU): what a sampler's logprobs must equal."""
    from grouprl.model.logprobs import completion_logprobs

    device = next(model.parameters()).device
    prompt, ids = torch.tensor([prompt_ids], device=device), torch.tensor([completion_ids], device=device)
    with torch.no_grad():
        out = completion_logprobs(
            model,
            prompt,
            torch.ones_like(prompt, dtype=torch.bool),
            ids,
            torch.ones_like(ids, dtype=torch.bool),
            temperature=temperature,
        )
    return out.logprobs[0].cpu()


def scripted_backend(model_dir) -> ScriptedBackend:
    """Completions of 1-6 tokens, some ending with EOS, depending on the prompt and the sample index."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id

    def script(prompt_ids, sample):
        body = [(prompt_ids[-1] + 7 * sample + k) % 200 + 3 for k in range(1 + (sample * 3 + len(prompt_ids)) % 6)]
        return body + ([eos] if sample % 3 else [])

    return ScriptedBackend(script, eos, tokenizer)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block, the caller's restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
