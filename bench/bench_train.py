"""One GRPO training benchmark run: `python bench_train.py --framework grouprl|trl --workload W1`.

The script is the same for both frameworks except the import (grouprl is a drop-in for TRL);
run it with each framework's own interpreter. Prints one JSON line with the measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from workloads import (
    WORKLOADS,
    chat_prompts_for,
    cpu_flags,
    isa_limits,
    model_dir,
    native_bf16,
    parameter_count,
    peak_rss_mb,
    prompts_for,
)  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=["grouprl", "trl"], required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--output_dir", default="/tmp/grouprl-bench")
    parser.add_argument("--steps", type=int, default=None, help="Override the workload's step count (smoke tests).")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "auto"],
        default="fp32",
        help="bf16: autocast in bf16 (bf16=True); auto: bf16 where the CPU has native bf16 (AVX512-BF16/AMX), "
        "else fp32.",
    )
    args = parser.parse_args()
    if args.framework == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grouprl import GRPOConfig, GRPOTrainer

    workload = WORKLOADS[args.workload]
    if args.steps:
        workload.steps = args.steps
    path = model_dir(workload)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = prompts_for(workload)
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and native_bf16())
    rows = (
        chat_prompts_for(workload) if workload.real_model else prompts
    )  # W5: conversations, the model's chat template
    dataset = Dataset.from_dict({"prompt": rows * workload.steps})
    generated = []

    def count_tokens(completion_ids, **kwargs):  # reward = length; also records generated tokens per step
        generated.append(sum(len(c) for c in completion_ids))
        return [float(len(c)) for c in completion_ids]

    config = GRPOConfig(
        output_dir=os.path.join(args.output_dir, f"{args.framework}-{workload.name}"),
        per_device_train_batch_size=workload.prompts * workload.num_generations,
        num_generations=workload.num_generations,
        max_completion_length=workload.max_completion_length,
        max_steps=workload.steps,
        learning_rate=1e-6,
        bf16=bf16,  # only where the CPU has bf16 units: emulated bf16 is ~100x slower (see docs/benchmarks.md)
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        shuffle_dataset=False,
        seed=0,
        # grouprl only: let glibc keep freed blocks for reuse (a process-wide setting grouprl makes only when asked)
        **({"keep_freed_host_memory": True} if args.framework == "grouprl" else {}),
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=count_tokens, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    steps = [e for e in trainer.state.log_history if "step_time" in e]
    timed = steps[1:] or steps  # the first step is warm-up
    step_seconds = sum(e["step_time"] for e in timed) / len(timed)
    tokens = generated[1:] or generated
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    n_params = parameter_count(workload)
    mean_generated = sum(tokens) / len(tokens)
    completions = workload.prompts * workload.num_generations
    # Useful work: one forward per prompt token and generated token to sample, and a forward + backward
    # (3 forward-equivalents) over every distinct prompt once and every generated token. Recomputation
    # (gradient checkpointing, a prompt re-run for each of its G rows) is not useful work.
    useful_flops = (2 + 6) * n_params * (prompt_tokens + mean_generated)
    print(
        json.dumps(
            {
                "framework": args.framework,
                "workload": workload.name,
                "seconds_per_step": step_seconds,
                "generated_tokens_per_step": mean_generated,
                "completions_per_step": completions,
                "generated_tokens_per_second": mean_generated / step_seconds,
                "peak_rss_mib": peak_rss_mb(),
                "useful_gflops_per_second": useful_flops / step_seconds / 1e9,
                "parameters": n_params,
                "total_seconds": total,
                "dtype": "bf16" if bf16 else "fp32",
                "cpu_flags": cpu_flags(),
                "isa_limits": isa_limits(),
                "load_average": os.getloadavg(),
                # where a timed step goes (grouprl logs time/<phase> per optimizer step; TRL logs none)
                "phase_seconds": {
                    key.removeprefix("time/"): sum(e[key] for e in timed if key in e) / len(timed)
                    for key in sorted({k for e in timed for k in e if k.startswith("time/")})
                },
            }
        )
    )


if __name__ == "__main__":
    main()
