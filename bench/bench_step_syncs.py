"""Host syncs and collectives per micro-step and per optimizer step of GRPO training, counted by instrumentation.

    python bench/bench_step_syncs.py MODEL_DIR [--processes 2]

Launches `accelerate launch` on CPU processes (gloo) and, on the main process, counts calls of
    host syncs:   Tensor.item, Tensor.tolist, float(tensor), bool(tensor)  (each one a device -> host wait on a GPU)
    collectives:  torch.distributed all_reduce / all_gather / all_gather_into_tensor / broadcast / *_object
while training 4 optimizer steps (loss "grpo", 2 micro-steps per optimizer step, one generation per optimizer step).
It reports the counts inside training_step on micro-steps that did not generate (the micro-step itself: forward,
loss, statistics, backward) and per optimizer step outside training_step (clip, reduction, logging). DDP's gradient
all-reduce inside backward is not a Python call and is not counted. On CPU an .item() is cheap; the counts are
what would stall a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

COUNTED_SYNCS = ("item", "tolist", "__float__", "__bool__")
COUNTED_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_gather_object",
    "broadcast_object_list",
    "reduce_scatter",
    "gather_object",
)


def instrument(counts: Counter) -> None:
    import torch

    for name in COUNTED_SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts["host_syncs"] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    for name in COUNTED_COLLECTIVES:
        original = getattr(torch.distributed, name)

        def counted_collective(*args, _original=original, **kwargs):
            counts["collectives"] += 1
            return _original(*args, **kwargs)

        setattr(torch.distributed, name, counted_collective)


def worker(model_dir: str, out_path: str) -> None:
    import datasets
    from transformers import AutoTokenizer

    from grouprl import GRPOConfig, GRPOTrainer

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out_path), "run"),
        per_device_train_batch_size=8 // processes,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
        loss_type="grpo",
        beta=0.0,
    )
    data = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(32)]})
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=lambda completion_ids, **k: [float(len(set(c))) for c in completion_ids],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    counts: Counter = Counter()
    instrument(counts)
    micro: list[dict] = []
    step = trainer.training_step

    def measured_step(model, inputs, num_items_in_batch=None):
        generates = not trainer.run.pending
        before = Counter(counts)
        loss = step(model, inputs, num_items_in_batch)
        micro.append({"generates": generates, **{k: counts[k] - before[k] for k in ("host_syncs", "collectives")}})
        return loss

    trainer.training_step = measured_step
    total_before = Counter(counts)
    trainer.train()
    total = {k: counts[k] - total_before[k] for k in ("host_syncs", "collectives")}
    inside = {k: sum(m[k] for m in micro) for k in ("host_syncs", "collectives")}
    plain = [m for m in micro if not m["generates"]]
    steps = trainer.state.global_step
    result = {
        "processes": processes,
        "micro_steps": len(micro),
        "per_plain_micro_step": {
            k: sum(m[k] for m in plain) / max(len(plain), 1) for k in ("host_syncs", "collectives")
        },
        "per_optimizer_step_outside_training_step": {
            k: (total[k] - inside[k]) / steps for k in ("host_syncs", "collectives")
        },
        "per_optimizer_step_all": {k: total[k] / steps for k in ("host_syncs", "collectives")},
    }
    if trainer.accelerator.is_main_process:
        with open(out_path, "w") as handle:
            json.dump(result, handle)


def main() -> None:
    model_dir = sys.argv[1]
    processes = int(sys.argv[sys.argv.index("--processes") + 1]) if "--processes" in sys.argv else 2
    out_dir = os.path.abspath(os.environ.get("BENCH_OUT", "/tmp/bench_step_syncs"))
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, "counts.json")
    from grouprl.launch import resolve_accelerate_config

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        resolve_accelerate_config("multi_gpu"),
        "--num_processes",
        str(processes),
        "--main_process_port",
        "29533",
        __file__,
        "--worker",
        model_dir,
        out_path,
    ]
    if processes == 1:
        command = [sys.executable, __file__, "--worker", model_dir, out_path]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(done.stderr[-4000:])
    with open(out_path) as handle:
        print(json.dumps(json.load(handle), indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
