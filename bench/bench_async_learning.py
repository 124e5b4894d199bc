"""Does asynchronous GRPO learn as much per optimizer step as synchronous GRPO? Learning curves of both.

    python bench/bench_async_learning.py [--seeds 0 1 2 3 4 5] [--steps 12]

The TRL quick-start case (four prompts, reward = the number of distinct characters of a completion) on the
demo's tiny model, lr 3e-3: synchronous, async with max_staleness=0 (the worker waits for the weights it is
trained with) and async with max_staleness=1 (one step off-policy). Each run's held-out reward (128 fresh
samples of the same prompts, fixed seed) is measured before and after training, and every step's mean
training reward is kept. Writes bench/results/async_learning.json and, with --plot, the mean curves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "async_learning.json")
PROMPTS = ["The sky is", "Once upon a time", "def add(a, b):", "Hello"]
MODES = {"sync": {}, "async0": {"max_staleness": 0}, "async1": {"max_staleness": 1}}


def distinct_characters(completions, **kwargs):
    return [float(len(set(text))) for text in completions]


def run_one(model_dir: str, mode: str, seed: int, steps: int) -> dict:
    from datasets import Dataset

    from grouprl import GRPOConfig, GRPOTrainer

    extra = {"async_generation": True, "generation_threads": 1, **MODES[mode]} if mode != "sync" else {}
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix=f"grouprl-async-learning-{mode}-"),
        max_steps=steps,
        learning_rate=3e-3,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=24,
        num_generations_eval=32,
        per_device_eval_batch_size=32,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        bf16=False,
        use_cpu=True,
        **extra,
    )
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=distinct_characters, args=config, train_dataset=dataset, eval_dataset=dataset
    )
    before = trainer.evaluate()["eval_reward"]
    trainer.train()
    after = trainer.evaluate()["eval_reward"]
    entries = [e for e in trainer.state.log_history if "reward" in e and "train_runtime" not in e]
    return {
        "mode": mode,
        "seed": seed,
        "held_out_before": before,
        "held_out_after": after,
        "gain": after - before,
        "rewards": [e["reward"] for e in entries],
        "staleness_max": [e.get("async/staleness_max") for e in entries],
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for mode in MODES:
        curves = [r["rewards"] for r in results if r["mode"] == mode]
        if curves:
            mean = [statistics.mean(step) for step in zip(*curves)]
            axis.plot(range(1, len(mean) + 1), mean, label=f"{mode} (mean of {len(curves)} seeds)")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean training reward (distinct characters)")
    axis.set_title("Synchronous vs asynchronous GRPO, TRL quick-start case, tiny model")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--plot", help="Write the mean learning curves to this PNG.")
    parser.add_argument("--one", nargs=4, metavar=("MODEL_DIR", "MODE", "SEED", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model_dir, mode, seed, steps = args.one
        print(json.dumps(run_one(model_dir, mode, int(seed), int(steps))))
        return
    from grouprl.demo.model import save_tiny_model

    # the quick-start prompts with room for their completions
    model_dir = save_tiny_model(tempfile.mkdtemp(prefix="grouprl-async-learning-model-"), max_position_embeddings=1024)
    results = []
    for seed in args.seeds:
        for mode in args.modes:  # modes alternate within a seed: the same machine conditions for each
            command = [sys.executable, __file__, "--one", model_dir, mode, str(seed), str(args.steps)]
            out = subprocess.run(command, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{mode} seed {seed} failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps({k: results[-1][k] for k in ("mode", "seed", "gain")}), flush=True)
    print(f"\n{'mode':7} {'seeds':>5} {'mean gain':>10} {'stdev':>6}  per seed")
    for mode in args.modes:
        gains = [r["gain"] for r in results if r["mode"] == mode]
        spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
        listed = ", ".join(f"{g:.2f}" for g in gains)
        print(f"{mode:7} {len(gains):5d} {statistics.mean(gains):10.2f} {spread:6.2f}  {listed}")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as handle:
        json.dump(results, handle, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
