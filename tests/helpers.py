"""Test helpers: a deterministic generation backend and small comparison utilities."""

from typing import Callable

import torch

from grouprl.types import Completion, SamplingParams


class ScriptedBackend:
    """Returns completions decided by `script(prompt_ids, sample_index) -> token ids` (EOS included or not).

    Lets tests inject the same completions into differently configured runs, so sampling noise
    cannot hide a bug.
    """

    def __init__(self, script: Callable[[list[int], int], list[int]], eos_token_id: int, tokenizer=None):
        self.script, self.eos, self.tokenizer = script, eos_token_id, tokenizer
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
                out.append(Completion(p, tokens, text, "stop" if tokens and tokens[-1] == self.eos else "length"))
        return out


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_difference(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
