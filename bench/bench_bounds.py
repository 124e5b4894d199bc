"""The fewest seconds per step this CPU allows for a workload: its matrix products alone, at measured speed.

    python bench/bench_bounds.py [--dtype fp32|bf16|auto] [W1 W2 W3 W4]

The matrix products of a GRPO step are fixed by the model and the workload, whatever the library:
- prefill: each distinct prompt token once through every weight matrix;
- decode: each step multiplies the rows still generating (a few dozen) by every weight matrix, the
  LM head included; with few rows these products are slow per FLOP (the weights stream from memory);
- training: every prompt (once) and generated token through every layer weight four times: forward,
  the gradient-checkpointing recomputation, and the two products of backward (input and weight
  gradients); the LM head only at completion positions.
Each product is timed here on its real shapes, with distinct weight tensors (as in the model, so
the weights come from memory as they do in a step), fastest of several runs, and nothing else: no
attention, norms, sampling, optimizer or Python. The sum estimates a floor for any implementation on
this machine (an estimate: on a shared 2-core machine the same product varies by ~10% between runs). Decode
schedules (rows alive at each step) come from a seeded FastGenerator run, except W3 (8 rows for all
512 steps, its EOS is one token of 151,936). With --dtype bf16 (or auto on a CPU with native bf16) the
products run in bf16, as under the bf16 autocast that bench_train.py --dtype bf16 trains with.
Prints one JSON line per workload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from workloads import WORKLOADS, model_dir, native_bf16, prompts_for  # noqa: E402

from grouprl.core.types import SamplingParams  # noqa: E402
from grouprl.generation import FastGenerator  # noqa: E402

TRAIN_ROWS = 4096  # tokens per product when timing the training shapes (a micro-batch's worth)


def _fastest_seconds(fn, repeats: int = 7) -> float:
    """The fastest of `repeats` timed calls: on a shared machine, the closest to what the hardware can do."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _weights(model: torch.nn.Module) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(weight matrices of the decoder layers, the LM head's weight)."""
    head = model.get_output_embeddings().weight
    layers = [m.weight.detach() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    return layers, head.detach()


def decode_seconds(layers: list[torch.Tensor], head: torch.Tensor, rows: int) -> float:
    """One decode step's products for `rows` rows: every layer weight and the LM head, in the fastest of
    x @ W^T and W @ x^T with and without rows padded to a multiple of 16 (grouprl's engine computes
    few rows weight-major; cpu_products.py)."""
    weights = layers + [head]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    padded = {w.shape[1]: torch.randn(-(-rows // 16) * 16, w.shape[1], dtype=w.dtype) for w in weights}
    row_major = _fastest_seconds(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])
    weight_major = _fastest_seconds(lambda: [w @ inputs[w.shape[1]].t() for w in weights])
    weight_major_padded = _fastest_seconds(lambda: [w @ padded[w.shape[1]].t() for w in weights])
    return min(row_major, weight_major, weight_major_padded)


def per_token_seconds(weights: list[torch.Tensor]) -> dict[str, float]:
    """Seconds per token of the forward, input-gradient and weight-gradient products over `weights`."""
    x = {w.shape[1]: torch.randn(TRAIN_ROWS, w.shape[1], dtype=w.dtype) for w in weights}
    g = {w.shape[0]: torch.randn(TRAIN_ROWS, w.shape[0], dtype=w.dtype) for w in weights}
    return {
        "forward": _fastest_seconds(lambda: [F.linear(x[w.shape[1]], w) for w in weights], 3) / TRAIN_ROWS,
        "input_grad": _fastest_seconds(lambda: [g[w.shape[0]] @ w for w in weights], 3) / TRAIN_ROWS,
        "weight_grad": _fastest_seconds(lambda: [g[w.shape[0]].t() @ x[w.shape[1]] for w in weights], 3) / TRAIN_ROWS,
    }


def schedule(name: str, model, tokenizer) -> list[int]:
    """Rows in the decode batch at each step of a seeded FastGenerator run (W3: all 8 rows for 512 steps)."""
    workload = WORKLOADS[name]
    if name == "W3":
        return [workload.prompts * workload.num_generations] * workload.max_completion_length
    eos = model.generation_config.eos_token_id
    generator = FastGenerator(model, tokenizer, eos if isinstance(eos, list) else [eos], tokenizer.pad_token_id)
    torch.manual_seed(0)
    generator.generate(
        [tokenizer(p)["input_ids"] for p in prompts_for(workload)],
        workload.num_generations,
        SamplingParams(max_new_tokens=workload.max_completion_length),
    )
    return list(generator.decode_batch_sizes)


def main(names: list[str], dtype: torch.dtype = torch.float32) -> None:
    cache: dict[str, tuple] = {}
    for name in names:
        workload = WORKLOADS[name]
        path = model_dir(workload)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        key = (workload.hidden_size, workload.num_hidden_layers, workload.vocab_size)
        rows = schedule(name, model, tokenizer)  # the fp32 model's schedule: the runs sample the same way
        layers, head = _weights(model)
        layers, head = [w.to(dtype) for w in layers], head.to(dtype)
        with torch.no_grad():
            if key not in cache:
                cache[key] = (per_token_seconds(layers), per_token_seconds([head]), {})
            layer_rate, head_rate, decode_cache = cache[key]
            for r in set(rows):
                if r not in decode_cache:
                    decode_cache[r] = decode_seconds(layers, head, r)
        prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts_for(workload))
        generated = sum(rows)  # one token per alive row per step
        decode = sum(decode_cache[r] for r in rows)
        prefill = prompt_tokens * layer_rate["forward"]
        trained = prompt_tokens + generated
        train = trained * (
            2 * layer_rate["forward"] + layer_rate["input_grad"] + layer_rate["weight_grad"]
        ) + generated * (head_rate["forward"] + head_rate["input_grad"] + head_rate["weight_grad"])
        print(
            json.dumps(
                {
                    "workload": name,
                    "dtype": str(dtype).replace("torch.", ""),
                    "floor_seconds_per_step": decode + prefill + train,
                    "decode_floor_seconds": decode,
                    "prefill_floor_seconds": prefill,
                    "train_floor_seconds": train,
                    "generated_tokens": generated,
                    "decode_ms_per_step_by_rows": {str(r): round(1e3 * decode_cache[r], 2) for r in sorted(set(rows))},
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workloads", nargs="*", default=["W1", "W2", "W3", "W4"])
    parser.add_argument("--dtype", choices=["fp32", "bf16", "auto"], default="fp32")
    args = parser.parse_args()
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and native_bf16())
    main(args.workloads, torch.bfloat16 if bf16 else torch.float32)
