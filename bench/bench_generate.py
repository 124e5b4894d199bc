"""Generation alone on W2 (shared ~400-token prompt, 4 prompts x 8, 128 new tokens):
grouprl's FastGenerator vs transformers `generate` and transformers continuous batching (`generate_batch`,
use_transformers_continuous_batching), same model, same sampling settings, fp32.
Prints one JSON line per backend."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from workloads import WORKLOADS, model_dir, prompts_for  # noqa: E402

from grouprl.core.types import SamplingParams  # noqa: E402
from grouprl.generation import FastGenerator, TransformersGenerator  # noqa: E402
from grouprl.generation.continuous_batching import ContinuousBatchingGenerator  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "W2"
    workload = WORKLOADS[name]
    path = model_dir(workload)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)  # an int for SmolLM2 (W5), a list for the built models
    prompts = [tokenizer(p)["input_ids"] for p in prompts_for(workload)]
    params = SamplingParams(max_new_tokens=workload.max_completion_length)
    backends = {
        "transformers.generate": TransformersGenerator(model, tokenizer, eos, tokenizer.pad_token_id),
        "transformers.generate_batch": ContinuousBatchingGenerator(model, tokenizer, eos, tokenizer.pad_token_id),
        "grouprl FastGenerator": FastGenerator(model, tokenizer, eos, tokenizer.pad_token_id),
    }
    for label, backend in backends.items():
        backend.generate(prompts[:1], 2, SamplingParams(max_new_tokens=4))  # warm-up
        timings, tokens = [], []
        for seed in range(2):
            torch.manual_seed(seed)
            start = time.perf_counter()
            completions = backend.generate(prompts, workload.num_generations, params)
            timings.append(time.perf_counter() - start)
            tokens.append(sum(len(c.token_ids) for c in completions))
        print(
            json.dumps(
                {
                    "workload": name,
                    "backend": label,
                    "seconds": sum(timings) / len(timings),
                    "generated_tokens": sum(tokens) / len(tokens),
                    "tokens_per_second": sum(tokens) / sum(timings),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
