"""Where one GRPO step's time goes on a GPU: torch.profiler over one optimizer step of grouprl (after a warm-up
step), on a case of bench_generation.py's plan; prints the operators by GPU time and by CPU time.

    python3 bench/gpu/profile_step.py --case 1 --engine captured            # on the GPU
    python3 bench/gpu/profile_step.py --case 1 --memory --trace             # + what holds the peak, the timeline
    python3 bench/gpu/profile_step.py --tiny --device cpu                   # a dry run here

Allow it two minutes on an H200 for the 0.5B case: the tables are built from every kernel of the step (a
60-second limit stopped it while building them).
"""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
import shutil
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_peak  # noqa: E402
from bench_generation import (
    PLAN,
    SHAPES,
    TINY_PLAN,
    build_model,
    config_kwargs,
    engine_config,
    load_tokenizer,
    one_token_reward,
    prompts_of,
)  # noqa: E402,I001


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--case", type=int, default=1, help="1-based case number of the plan")
    parser.add_argument("--engine", default="captured", help="captured, captured+compile, engine or transformers")
    parser.add_argument("--trace", action="store_true", help="also write the step's timeline, gzipped, beside --out")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="CUDA: what holds memory at the step's peak (memory_peak.py), and its snapshot",
    )
    parser.add_argument("--rows", type=int, default=30, help="operators per table")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "profile_step.txt"))
    args = parser.parse_args()
    import datasets
    from transformers import TrainerCallback

    from grouprl import GRPOConfig, GRPOTrainer

    case = (TINY_PLAN if args.tiny else PLAN)[args.case - 1]
    cuda = args.device == "cuda"
    model_dir = build_model(
        SHAPES[case.shape], args.device, torch.bfloat16 if cuda else torch.float32, f"/tmp/bench-gpu/model-{case.shape}"
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiler = profile(activities=activities, record_shapes=False)

    memory = {}

    class ProfileSecondStep(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kwargs):
            if state.global_step == 1:
                if args.memory:
                    memory["allocated_before"] = torch.cuda.memory_allocated()
                    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
                profiler.__enter__()

        def on_step_end(self, args_, state, control, **kwargs):
            if state.global_step == 2:
                if cuda:
                    torch.cuda.synchronize()
                profiler.__exit__(None, None, None)
                if args.memory:
                    memory.update(torch.cuda.memory._snapshot())
                    torch.cuda.memory._record_memory_history(enabled=None)

    kwargs = config_kwargs(case, "/tmp/bench-gpu/profile", cuda)
    kwargs["max_steps"] = 2
    extra = {} if cuda else {"use_cpu": True}
    config = GRPOConfig(**kwargs, **engine_config(args.engine), **extra)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=one_token_reward,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts_of(case, SHAPES[case.shape].vocab)}),
        processing_class=load_tokenizer(model_dir),
        callbacks=[ProfileSecondStep()],
    )
    trainer.train()
    phases = {k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("time/") or k == "step_time"}
    averages = profiler.key_averages()
    tables = [f"{case.name}, engine {args.engine}, step 2; logged: {phases}"]
    for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        tables.append(averages.table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
    text = "\n\n".join(tables)
    print(text)
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(text)
    if memory:  # what holds memory at the step's peak, and the snapshot for memory_peak.py / pytorch.org/memory_viz
        print(memory_peak.report(memory))
        with gzip.open(os.path.splitext(args.out)[0] + ".memory.pickle.gz", "wb") as handle:
            pickle.dump(memory, handle)
    if args.trace:  # the step's timeline (chrome://tracing or ui.perfetto.dev): where the GPU waits for the host
        trace = os.path.splitext(args.out)[0] + ".trace.json"
        profiler.export_chrome_trace(trace)
        with open(trace, "rb") as raw, gzip.open(trace + ".gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        os.remove(trace)
        print(f"timeline: {trace}.gz")


if __name__ == "__main__":
    main()
