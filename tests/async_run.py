"""Subprocess of test_async_resume.py: an asynchronous training run that records which prompts each step trains on.

    python async_run.py MODEL_DIR OUTPUT_DIR [resume] [kill_worker_at=STEP,...]

Each optimizer step's prompts (their `idx` column, as the reward function scores them) go to
OUTPUT_DIR/trained.jsonl (trained-RANK.jsonl on process RANK > 0) as {"step": global step, "idx": [...]}, flushed
at once, so a SIGKILL loses nothing written; a run that ends writes its logged history to
OUTPUT_DIR/log_history.json. Launched on several processes (accelerate launch), each process gets an equal share of
the same global batch. kill_worker_at: SIGKILL the generation worker when those steps end
(the crash tests).
"""

import json
import os
import signal
import sys
import time

import datasets
from transformers import TrainerCallback

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.generation.server_client import ServerClient


def make_trainer(model_dir, output_dir, **overrides):
    rank, processes = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    log = open(os.path.join(output_dir, f"trained-{rank}.jsonl" if rank else "trained.jsonl"), "a")

    def distinct_tokens(completion_ids, idx, trainer_state, **kwargs):
        log.write(json.dumps({"step": trainer_state.global_step, "idx": sorted(set(idx))}) + "\n")
        log.flush()
        time.sleep(0.2)  # the worker gets ahead: drawn-but-untrained batches exist at every checkpoint
        return [float(len(set(ids))) for ids in completion_ids]

    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8 // processes,
        num_generations=4,
        max_completion_length=8,
        learning_rate=0.02,
        max_steps=8,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
        async_generation=True,
        max_staleness=2,
        generation_threads=1,
    )
    values.update(overrides)
    prompts = datasets.Dataset.from_dict({"prompt": [f"{i}+{i % 5}=" for i in range(40)], "idx": list(range(40))})
    return GRPOTrainer(
        model=str(model_dir), reward_funcs=distinct_tokens, args=GRPOConfig(**values), train_dataset=prompts
    )


class KillWorker(TrainerCallback):
    """SIGKILL the worker at the end of the given steps; a later kill waits for the restarted worker first."""

    def __init__(self, trainer, steps):
        self.trainer, self.steps, self.killed = trainer, steps, set()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step not in self.steps:
            return
        producer = self.trainer.run.rollouts.source.producer
        worker = producer.worker
        deadline = time.monotonic() + 120
        # the trainer has finished restarting the worker after each earlier kill (not only: the new one answers)
        while producer.epoch < len(self.killed) or producer.restarting or not answers(worker.url):
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.1)
        self.killed.add(worker.process.pid)
        os.kill(worker.process.pid, signal.SIGKILL)


def answers(url):
    try:
        ServerClient(url).health(timeout=2.0)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    options = dict(arg.split("=", 1) if "=" in arg else (arg, "1") for arg in sys.argv[3:])
    os.makedirs(output_dir, exist_ok=True)
    trainer = make_trainer(model_dir, output_dir)
    if "kill_worker_at" in options:
        trainer.add_callback(KillWorker(trainer, {int(s) for s in options["kill_worker_at"].split(",")}))
    trainer.train(resume_from_checkpoint=True if "resume" in options else None)
    if trainer.accelerator.is_main_process:
        with open(os.path.join(output_dir, "log_history.json"), "w", encoding="utf-8") as handle:
            json.dump(trainer.state.log_history, handle)
    print("finished at step", trainer.state.global_step, flush=True)
