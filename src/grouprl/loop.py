"""The GRPO training loop, top to bottom.

    until max steps:
        for each of gradient_accumulation_steps micro-batches:
            if no micro-batch is buffered: generate -> score -> advantages -> (old logprobs) ->
                shuffle rows -> split into steps_per_generation micro-batches, queued num_iterations times
            forward the micro-batch -> policy loss -> backward
        clip gradients -> optimizer step -> LR step -> log -> checkpoint

The buffer semantics are TRL's (§2.13): one generation feeds steps_per_generation x num_iterations
micro-steps, replayed in the same order each iteration, independently of where optimizer steps
fall. Everything needed to continue exactly (sampler position, buffered micro-batches, RNG) is in
`loop_state` and saved with each checkpoint.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from .algorithms.logprobs import completion_logprobs
from .algorithms.losses import dapo_denominator, masked_mean, policy_loss
from .checkpoint import save_checkpoint
from .config import BatchPlan, GRPOConfig, resolve_steps
from .distributed import global_mean
from .evaluation import should_evaluate
from .metrics import JsonlWriter, MetricWindow, PhaseTimer, format_log_line
from .rollout import RolloutMaker
from .types import TrainBatch


@dataclass
class TrainingRun:
    """The parts of a run the loop works with; built by GRPOTrainer."""

    config: GRPOConfig
    plan: BatchPlan
    accelerator: Accelerator
    model: torch.nn.Module  # prepared by accelerate
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rollouts: RolloutMaker
    state: Any  # transformers.TrainerState
    total_steps: int
    steps_per_epoch: Optional[int]
    window: MetricWindow = field(default_factory=MetricWindow)
    pending: deque = field(default_factory=deque)  # micro-batches (TrainBatch) not yet trained on
    evaluate: Optional[Callable[[], Any]] = None  # runs evaluation and logs it (set when eval_strategy != "no")
    step_losses: list[float] = field(default_factory=list)

    @property
    def timer(self) -> PhaseTimer:
        return PhaseTimer(self.window)

    def loop_state(self) -> dict[str, Any]:
        return {
            "sampler": self.rollouts.sampler.state_dict(),
            "pending": list(self.pending),
            "generations_made": self.rollouts.generations_made,
            "tokens_seen": self.rollouts.tokens_seen,
            "step_losses": list(self.step_losses),
            "window": {k: list(v) for k, v in self.window.values.items()},
        }

    def load_loop_state(self, state: dict[str, Any]) -> None:
        self.rollouts.sampler.load_state_dict(state["sampler"])
        self.pending = deque(state["pending"])
        self.rollouts.generations_made = state["generations_made"]
        self.rollouts.tokens_seen = state["tokens_seen"]
        self.step_losses = list(state["step_losses"])
        self.window.clear()
        for name, values in state["window"].items():
            self.window.values[name].extend(values)


def generation_micro_batches(run: TrainingRun) -> list[TrainBatch]:
    """Generate and score one generation batch; return its micro-batches in training order."""
    config, plan, accelerator = run.config, run.plan, run.accelerator
    with run.timer.phase("generate"), accelerator.autocast():
        rollout = run.rollouts.sample()
    with run.timer.phase("reward"):
        _, advantages = run.rollouts.score(rollout, run.state, run.window)
    batch = run.rollouts.make_train_batch(rollout, advantages)
    if plan.old_logprobs_needed:  # samples will be reused after an optimizer step: remember pi_old
        with run.timer.phase("old_logprobs"), torch.no_grad(), accelerator.autocast():
            b = batch.to(accelerator.device)
            old, _ = completion_logprobs(
                run.model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                temperature=config.temperature, rows_per_chunk=plan.per_device_batch_size, with_entropy=False,
            )
            batch.old_logprobs = old.cpu()
    order = torch.randperm(len(batch))  # global RNG, seeded: reproducible and restored on resume
    size = len(batch) // plan.steps_per_generation  # per_device_batch_size, or fewer when GFPO dropped rows
    micro = [batch.select(order[i * size : (i + 1) * size]) for i in range(plan.steps_per_generation)]
    return micro * plan.num_iterations


def train_micro_batch(run: TrainingRun, micro: TrainBatch) -> float:
    """Forward, loss and backward of one micro-batch; returns the (already GA-scaled) loss."""
    config, plan, accelerator = run.config, run.plan, run.accelerator
    b = micro.to(accelerator.device)
    with run.timer.phase("forward"), accelerator.autocast():
        logprobs, entropy = completion_logprobs(
            run.model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, temperature=config.temperature
        )
        loss, stats = policy_loss(
            config.loss_type, logprobs, b.old_logprobs, b.advantages, b.loss_mask,
            epsilon_low=config.epsilon,
            epsilon_high=config.effective_epsilon_high,
            grad_accum_steps=plan.gradient_accumulation_steps,
            max_completion_length=config.max_completion_length,
            token_denominator=dapo_denominator(
                micro.num_loss_tokens, num_processes=plan.num_processes,
                grad_accum_steps=plan.gradient_accumulation_steps, steps_per_generation=plan.steps_per_generation,
            ),
        )
    with run.timer.phase("backward"):
        accelerator.backward(loss)
    run.window.add("entropy", global_mean(accelerator, masked_mean(entropy, b.completion_mask).item()))
    for name, value in stats.items():
        run.window.add(name, global_mean(accelerator, value.item()))
    return loss.item()


def optimizer_step(run: TrainingRun) -> tuple[float, float]:
    """Clip, step, schedule; returns (grad_norm before clipping, learning rate used)."""
    with run.timer.phase("optimizer"):
        params = [p for p in run.model.parameters() if p.requires_grad]
        max_norm = run.config.max_grad_norm if run.config.max_grad_norm > 0 else float("inf")
        grad_norm = run.accelerator.clip_grad_norm_(params, max_norm)
        learning_rate = run.scheduler.get_last_lr()[0]
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
    return float(grad_norm), learning_rate


def train(run: TrainingRun) -> dict[str, float]:
    config, state, accelerator = run.config, run.state, run.accelerator
    ga = run.plan.gradient_accumulation_steps
    logging_steps = resolve_steps(config.logging_steps, run.total_steps)
    save_steps = resolve_steps(config.save_steps, run.total_steps)
    writer = JsonlWriter(f"{config.output_dir}/metrics.jsonl") if accelerator.is_main_process else None
    progress = tqdm(total=run.total_steps, initial=state.global_step, desc="grouprl", disable=config.disable_tqdm or not accelerator.is_main_process)
    run.model.train()
    started, first_step = time.time(), state.global_step
    while state.global_step < run.total_steps:
        step_started = time.perf_counter()
        step_loss = 0.0
        for k in range(ga):
            if not run.pending:
                run.pending.extend(generation_micro_batches(run))
            micro = run.pending.popleft()
            with nullcontext() if k == ga - 1 else accelerator.no_sync(run.model):
                step_loss += train_micro_batch(run, micro)
        grad_norm, learning_rate = optimizer_step(run)
        state.global_step += 1
        state.epoch = state.global_step / run.steps_per_epoch if run.steps_per_epoch else None
        loss = global_mean(accelerator, step_loss)
        run.step_losses.append(loss)
        run.window.add_all({"loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate, "step_time": time.perf_counter() - step_started})
        if state.global_step % logging_steps == 0 or (config.logging_first_step and state.global_step == 1):
            write_log(run, writer, progress)
        if run.evaluate is not None and should_evaluate(config, state.global_step, run.total_steps, run.steps_per_epoch):
            run.evaluate()
        if should_save(config, state.global_step, save_steps, run.steps_per_epoch):
            save(run)
        progress.update(1)
        progress.set_postfix(reward=run.window.summary().get("reward"), refresh=False)
    progress.close()
    runtime = time.time() - started
    steps_done = max(state.global_step - first_step, 1)
    final = {
        "train_runtime": runtime,
        "train_samples_per_second": steps_done * run.plan.completions_per_optimizer_step / max(runtime, 1e-9),
        "train_steps_per_second": steps_done / max(runtime, 1e-9),
        "train_loss": sum(run.step_losses) / max(len(run.step_losses), 1),
        "epoch": state.epoch,
        "step": state.global_step,
    }
    state.log_history.append(final)
    if writer is not None:
        writer.write(final)
    return final


def write_log(run: TrainingRun, writer: Optional[JsonlWriter], progress: Any) -> None:
    entry = {**run.window.summary(), "epoch": run.state.epoch, "step": run.state.global_step}
    run.window.clear()
    run.state.log_history.append(entry)
    run.accelerator.log({k: v for k, v in entry.items() if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))}, step=run.state.global_step)
    if writer is not None:
        writer.write(entry)
        progress.write(format_log_line(entry, run.total_steps)) if not progress.disable else print(format_log_line(entry, run.total_steps), flush=True)
    if run.rollouts.completion_log is not None:  # log_completions: parquet, console table, tracker tables
        run.rollouts.completion_log.write(run.state.global_step, run.accelerator)


def should_save(config: GRPOConfig, step: int, save_steps: int, steps_per_epoch: Optional[int]) -> bool:
    if config.save_strategy == "steps":
        return step % save_steps == 0
    if config.save_strategy == "epoch":
        return bool(steps_per_epoch) and step % steps_per_epoch == 0
    return False


def save(run: TrainingRun) -> Optional[str]:
    """Checkpoint the run (main process writes; all processes wait for it)."""
    run.accelerator.wait_for_everyone()
    path = None
    if run.accelerator.is_main_process:
        path = save_checkpoint(
            run.config.output_dir,
            run.state.global_step,
            model=run.accelerator.unwrap_model(run.model),
            tokenizer=run.tokenizer,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            trainer_state=run.state,
            loop_state=run.loop_state(),
            save_total_limit=run.config.save_total_limit,
        )
    run.accelerator.wait_for_everyone()
    return path
