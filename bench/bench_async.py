"""Asynchronous vs synchronous GRPO on this machine's cores: steps per second and the learning curves of both.

    python bench/bench_async.py                       # W1 and W2 (add --workloads W1,W2,W5 for the real model)
    python bench/bench_async.py --one W1 sync         # one run, one JSON line (what the driver runs)

sync:  grouprl's synchronous loop; generation (the fast in-process engine) and training each use every core.
sync1: the same with one torch thread (a control: on a machine other work keeps busy, a two-thread process
       waits for its descheduled thread at every parallel region).
async: async_generation=True, max_staleness=1: a local `grouprl serve` worker samples with one core
       (generation_threads=1) while the trainer trains with the others, one step off-policy at most.

Both train on the same prompts with the same reward (the share of sampled tokens with an even id: a signal a
random model can learn in a few steps) and learning rate; the first `--warmup` optimizer steps (the worker's
start, one-time probes) are not timed. Each run is a separate process; the driver prints a table and writes
bench/results/async.json with the CPU flags and the load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import WORKLOADS, chat_prompts_for, cpu_flags, model_dir, prompts_for  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "async.json")


def even_token_share(completion_ids, **kwargs):
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def run_one(workload_name: str, mode: str, steps: int, warmup: int, learning_rate: float, staleness: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from grouprl import GRPOConfig, GRPOTrainer

    if mode == "sync1":
        torch.set_num_threads(1)
    workload = WORKLOADS[workload_name]
    path = model_dir(workload)
    rows = chat_prompts_for(workload) if workload.real_model else prompts_for(workload)
    dataset = Dataset.from_dict({"prompt": rows * (steps + warmup)})
    extra = (
        {"async_generation": True, "max_staleness": staleness, "generation_threads": 1, "async_worker": "local"}
        if mode == "async"
        else {}
    )
    config = GRPOConfig(
        output_dir=f"/tmp/grouprl-bench-async/{workload.name}-{mode}",
        per_device_train_batch_size=workload.prompts * workload.num_generations,
        num_generations=workload.num_generations,
        max_completion_length=workload.max_completion_length,
        max_steps=warmup + steps,
        learning_rate=learning_rate,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        shuffle_dataset=False,
        seed=0,
        keep_freed_host_memory=True,
        **extra,
    )
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=even_token_share,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(path),
        callbacks=[StepClock()],
    )
    load_before = os.getloadavg()
    trainer.train()
    timed = ends[warmup:]
    seconds = (timed[-1] - ends[warmup - 1]) / len(timed)
    entries = [e for e in trainer.state.log_history if "reward" in e and "train_runtime" not in e]
    return {
        "workload": workload.name,
        "mode": mode,
        "seconds_per_step": seconds,
        "steps_per_second": 1.0 / seconds,
        "timed_steps": len(timed),
        "rewards": [round(e["reward"], 4) for e in entries],
        "staleness_mean": [e.get("async/staleness_mean") for e in entries] if mode == "async" else None,
        "trainer_wait_s": [round(e.get("async/trainer_wait_s", 0.0), 3) for e in entries] if mode == "async" else None,
        "max_staleness": staleness if mode == "async" else None,
        "torch_threads": torch.get_num_threads(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "learning_rate": learning_rate,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--steps", type=int, default=8, help="Timed optimizer steps per run.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed optimizer steps first.")
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--max_staleness", type=int, default=1)
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "MODE"), help="Run one workload in one mode.")
    parser.add_argument("--modes", default="sync,async,sync1", help="Modes to run, in this order, per workload.")
    parser.add_argument("--output", default=RESULTS, help="Where the JSON results go.")
    args = parser.parse_args()
    if args.one:
        name, mode = args.one
        print(json.dumps(run_one(name, mode, args.steps, args.warmup, args.learning_rate, args.max_staleness)))
        return
    results = []
    for name in args.workloads.split(","):
        model_dir(WORKLOADS[name])  # built once, outside the timed runs
        for mode in args.modes.split(","):
            command = [sys.executable, os.path.abspath(__file__), "--one", name, mode]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            command += ["--learning_rate", str(args.learning_rate), "--max_staleness", str(args.max_staleness)]
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
            out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{name} {mode} failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps({k: results[-1][k] for k in ("workload", "mode", "steps_per_second", "rewards")}))
    print(f"\n{'workload':8} {'mode':6} {'s/step':>8} {'steps/s':>8} {'vs sync':>8}")
    for r in results:
        sync = next(s for s in results if s["workload"] == r["workload"] and s["mode"] == "sync")
        ratio = r["steps_per_second"] / sync["steps_per_second"]
        print(
            f"{r['workload']:8} {r['mode']:6} {r['seconds_per_step']:8.2f} {r['steps_per_second']:8.4f} {ratio:7.2f}x"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
