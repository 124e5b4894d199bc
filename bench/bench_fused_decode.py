"""FastGenerator with and without fused decode steps (generation/fused_step.py), alternating in one process.

    python bench/bench_fused_decode.py W5 --dtype bf16 --pairs 3

Same model, prompts (W5: its chat template), seed and sampling for both; multinomial sampling, so in fp32 both
draw the same tokens (the script reports how many completions are identical: in bf16 the two round differently
and drift apart). Prints the CPU flags, one JSON line per run and the median tokens/s of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from workloads import WORKLOADS, cpu_flags, model_dir, prompts_for  # noqa: E402

from grouprl.core.types import SamplingParams  # noqa: E402
from grouprl.generation import FastGenerator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: under bf16 autocast")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--lora", action="store_true", help="wrap the model in peft LoRA adapters (r=16, all linear layers, B random)"
    )
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    path = model_dir(workload)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.lora:  # as examples/real_model_smollm2.py --mode lora trains; B nonzero, as after some training
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=1e-3)
        model.eval()
    texts = prompts_for(workload)  # W5: its chat template rendered
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    params = SamplingParams(max_new_tokens=workload.max_completion_length)
    setting = {"workload": args.workload, "dtype": args.dtype, "lora": args.lora}
    print(json.dumps({"cpu_flags": cpu_flags(), **setting}), flush=True)
    rates: dict[bool, list[float]] = {False: [], True: []}
    identical = []
    for pair in range(args.pairs):
        tokens = {}
        for fused in (False, True):
            generator = FastGenerator(
                model, tokenizer, eos, tokenizer.pad_token_id, fuse_decode=fused, sampling_method="multinomial"
            )
            torch.manual_seed(pair)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                started = time.perf_counter()
                completions = generator.generate(prompts, workload.num_generations, params)
                seconds = time.perf_counter() - started
            tokens[fused] = [c.token_ids for c in completions]
            generated = sum(len(ids) for ids in tokens[fused])
            rates[fused].append(generated / seconds)
            run = {"pair": pair, "fused": fused, "seconds": round(seconds, 3), "generated_tokens": generated}
            print(json.dumps({**run, "tokens_per_second": round(generated / seconds, 1)}), flush=True)
        identical.append(sum(a == b for a, b in zip(tokens[False], tokens[True])))
    forward, fused = statistics.median(rates[False]), statistics.median(rates[True])
    summary = {"forward_tokens_per_second": round(forward, 1), "fused_tokens_per_second": round(fused, 1)}
    summary |= {"speedup": round(fused / forward, 2), "identical_completions_per_pair": identical}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
