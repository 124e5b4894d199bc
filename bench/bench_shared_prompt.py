"""Forward+backward time of completion_logprobs on a workload's 32 rows: plain pass vs prompt packing.

    OMP_NUM_THREADS=1 python bench/bench_shared_prompt.py W2 [repeats] [rows per prompt]

Prompts come from the workload (W2: ~400 shared tokens; W1: ~25), each repeated num_generations
times (or `rows per prompt` times: a shuffled training micro-batch holds only a few rows of each); completions are
random full-length token rows. Both paths run alternately in one process.
"""

from __future__ import annotations

import sys
import time

import torch
from transformers import AutoModelForCausalLM
from workloads import WORKLOADS, build_tokenizer, model_dir, prompts_for

from grouprl.model.logprobs import completion_logprobs
from grouprl.model.patches import grouprl_patches


def main(name: str, repeats: int, rows_per_prompt: int | None) -> None:
    workload = WORKLOADS[name]
    model = AutoModelForCausalLM.from_pretrained(model_dir(workload), dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tokenizer = build_tokenizer()
    batch = tokenizer(prompts_for(workload), padding=True, return_tensors="pt")
    g, t = rows_per_prompt or workload.num_generations, workload.max_completion_length
    prompt_ids = batch["input_ids"].repeat_interleave(g, 0)
    prompt_mask = batch["attention_mask"].bool().repeat_interleave(g, 0)
    completion_ids = torch.randint(
        1, workload.vocab_size, (prompt_ids.shape[0], t), generator=torch.Generator().manual_seed(0)
    )
    completion_mask = torch.ones_like(completion_ids, dtype=torch.bool)
    print(f"{name}: {prompt_ids.shape[0]} rows, prompt tokens {prompt_mask.sum(1).tolist()[::g]}, completion {t}")
    results: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats + 1):  # the first round warms up
        for pack in (False, True):
            model.zero_grad()
            start = time.perf_counter()
            with grouprl_patches():  # as in training: packed attention registered for the forward and backward
                out = completion_logprobs(
                    model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0, pack_prompts=pack
                )
                out.logprobs.sum().backward()
            results[pack].append(time.perf_counter() - start)
    plain, packed = (min(results[p][1:]) for p in (False, True))
    print(f"plain  {[round(s, 2) for s in results[False][1:]]} s")
    print(f"packed {[round(s, 2) for s in results[True][1:]]} s")
    print(f"best plain {plain:.2f} s, packed {packed:.2f} s, ratio plain/packed {plain / packed:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2, int(sys.argv[3]) if len(sys.argv) > 3 else None)
