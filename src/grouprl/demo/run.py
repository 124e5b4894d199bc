"""`grouprl demo`: GRPO on the built-in arithmetic task with the bundled tiny model.

The bundled model (`grouprl/demo/tiny_arith`, recipe in `grouprl.demo.pretrain`) was pretrained on
addition problems whose shown answers are right only ~40% of the time, so it knows the format but
samples the right sum rarely. GRPO with the verifiable `arithmetic_reward` (1 if the sum is right)
should raise its sampled accuracy within a couple of minutes on a laptop CPU. The demo measures
held-out accuracy before and after, and writes metrics.jsonl, reward_curve.png, summary.json and
the run report (report/index.html, as `grouprl report` writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

DEFAULTS = dict(
    output_dir="grouprl-demo",
    max_steps=80,
    prompts_per_step=16,
    num_generations=8,
    learning_rate=1e-3,
    seed=0,
    eval_rows=256,
)


def at_least(smallest: int) -> Any:
    """An argparse type: an integer >= `smallest` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < smallest:
            raise argparse.ArgumentTypeError(f"{value} is too small: it must be at least {smallest}")
        return value

    parse.__name__ = "integer"  # argparse's "invalid integer value" for a non-number
    return parse


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output_dir", default=DEFAULTS["output_dir"], help="Where metrics, the plot and the trained model go."
    )
    parser.add_argument("--max_steps", type=at_least(1), default=DEFAULTS["max_steps"], help="Optimizer steps of GRPO.")
    parser.add_argument(
        "--prompts_per_step", type=at_least(1), default=DEFAULTS["prompts_per_step"], help="Unique prompts per step."
    )
    parser.add_argument(
        "--num_generations", type=at_least(2), default=DEFAULTS["num_generations"], help="Completions per prompt (G)."
    )
    parser.add_argument("--learning_rate", type=float, default=DEFAULTS["learning_rate"])
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument(
        "--eval_rows",
        type=at_least(1),
        default=DEFAULTS["eval_rows"],
        help="Held-out problems for the before/after accuracy.",
    )
    parser.add_argument("--model", default=None, help="Start from this checkpoint instead of the bundled one.")


def run_demo(args: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grouprl.compat.trainer import GRPOTrainer
    from grouprl.config.grpo_config import GRPOConfig
    from grouprl.demo.evaluation import HELDOUT_SEED, sampled_accuracy
    from grouprl.demo.model import DEMO_MODEL_DIR
    from grouprl.demo.task import arithmetic_reward, make_arithmetic_dataset
    from grouprl.model.loading import check_local_model_path
    from grouprl.report.writer import write_report

    started = time.time()
    model_path = args.model or str(DEMO_MODEL_DIR)
    check_local_model_path(model_path)  # a mistyped --model path is named, not answered about Hub repo ids
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    heldout = make_arithmetic_dataset(args.eval_rows, seed=HELDOUT_SEED)
    train = make_arithmetic_dataset(args.max_steps * args.prompts_per_step, seed=args.seed + 1)
    before = sampled_accuracy(model, tokenizer, heldout, num_samples=4, seed=args.seed)
    print(f"grouprl demo: held-out sampled accuracy before GRPO: {before:.3f}", flush=True)

    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=6,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=5,
        logging_first_step=True,
        save_strategy="no",
        log_completions=True,  # sampled completions for the run report, not printed (num_completions_to_print=0)
        num_completions_to_print=0,
        gradient_checkpointing=False,  # a 0.5M-parameter model: activations are tiny, recomputing them costs time
        report_to="none",
        seed=args.seed,
        # a CPU run: freed tensors reused, not page-faulted in again (a process-wide setting)
        keep_freed_host_memory=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=train, processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "model"))
    trained = trainer.accelerator.unwrap_model(trainer.run.model)
    with torch.no_grad():
        after = sampled_accuracy(trained, tokenizer, heldout, num_samples=4, seed=args.seed)

    summary = {
        "heldout_sampled_accuracy_before": before,
        "heldout_sampled_accuracy_after": after,
        "steps": trainer.state.global_step,
        "seconds": round(time.time() - started, 1),
    }
    with open(os.path.join(args.output_dir, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    plot = plot_reward_curve(
        os.path.join(args.output_dir, "metrics.jsonl"), os.path.join(args.output_dir, "reward_curve.png")
    )
    report = write_report(args.output_dir)
    print(
        f"grouprl demo: held-out sampled accuracy {before:.3f} -> {after:.3f} after {summary['steps']} GRPO steps "
        f"({summary['seconds']} s)\n"
        f"  metrics (JSON lines): {os.path.join(args.output_dir, 'metrics.jsonl')}\n"
        f"  reward curve:         {plot}\n"
        f"  run report (HTML):    {report.html}\n"
        f"  summary:              {os.path.join(args.output_dir, 'summary.json')}\n"
        f"  trained model:        {os.path.join(args.output_dir, 'model')}",
        flush=True,
    )
    return summary


def plot_reward_curve(metrics_path: str, png_path: str) -> str:
    """Mean training reward (= sampled accuracy on training prompts) per logged step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [json.loads(line) for line in open(metrics_path, encoding="utf-8")]
    points = [(e["step"], e["reward"]) for e in entries if e.get("reward") is not None]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([s for s, _ in points], [r for _, r in points], marker="o")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("mean reward (accuracy)")
    axis.set_title("grouprl demo: GRPO on 2-number addition")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return png_path
