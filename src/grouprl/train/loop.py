"""The GRPO training loop, top to bottom.

    until max steps:
        for each of gradient_accumulation_steps micro-batches:
            if no micro-batch is buffered: draw the next generation's prompts (the `inputs` rows)
            training_step(inputs)                                                   (stages.py)
                prepare_inputs: if no micro-batch is buffered:
                    generate_and_score: generate -> score -> advantages
                        -> (old / reference logprobs, sampler IS weights)  (rollout/experience.py)
                        -> TrainBatch, ExperienceStats (recorded in run.ledger)
                    -> shuffle rows -> split into steps_per_generation micro-batches,
                       queued num_iterations times
                compute_loss: forward -> policy loss (micro_step.py) -> loss, LossStats (run.ledger)
                -> backward (optimizer_step.py)
        clip gradients -> reduce the step's statistics over every process, once (step_reduction.py;
        a NaN / inf anywhere stops every process here) -> optimizer step -> LR step
        -> statistics into the metric window -> entropy controller / reference sync
        -> log -> evaluate -> checkpoint
    log(train summary) -> on_train_end
    (TrainerCallback events fire at the same points as in transformers' Trainer: callbacks.py)

Each stage of stages.py is one of TRL's override points: where a GRPOTrainer subclass overrides it
(run.overrides), the subclass's version runs there with TRL's arguments; otherwise grouprl's own stage runs,
called directly. The loop and the parts of its step hold the run (`TrainingRun`, training_run.py); the
stages below them get what they use (the model, the batch, `Objective`, `Sampling`).

The buffer semantics are TRL's (§2.13): one generation feeds steps_per_generation x num_iterations
micro-steps, replayed in the same order each iteration, independently of where optimizer steps
fall. Everything needed to continue exactly (sampler position, buffered micro-batches, RNG) is in
`loop_state` and saved with each checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import torch
from accelerate.utils.memory import clear_device_cache
from tqdm.auto import tqdm

from grouprl.config.grpo_config import GRPOConfig, interval_due, resolve_steps
from grouprl.core.metrics import TRAINER_METRICS, progress_postfix
from grouprl.core.stats import metrics
from grouprl.rewards.scoring import RewardFunctionError
from grouprl.train import evaluation, stages
from grouprl.train.best_checkpoint import record_evaluation
from grouprl.train.checkpoint import load_policy_weights
from grouprl.train.evaluation import should_evaluate
from grouprl.train.last_good_state import save_last_good
from grouprl.train.non_finite import NonFiniteError
from grouprl.train.optimizer_step import (
    StepStats,
    accumulating,
    apply_update,
    as_loss,
    clip_gradients,
    end_of_step_updates,
    reduce_statistics,
    update_norm,
)
from grouprl.train.run_checkpoints import gathered_policy_state, save, should_save, write_checkpoint
from grouprl.train.stop_signals import StopSignals, exit_code, resume_hint
from grouprl.train.training_run import TrainingRun


def train(run: TrainingRun) -> dict[str, float]:
    """Train to max_steps; on NaN / inf or a failing reward function, save the last good state, then re-raise
    the error with where that state is."""
    describe = lambda: f"step {run.state.global_step + 1}"  # noqa: E731 - read when a signal arrives
    try:
        with StopSignals(describe, announce=run.accelerator.is_main_process) as stops:
            return train_steps(run, stops)
    except (NonFiniteError, RewardFunctionError) as err:
        # every process raises the same NonFiniteError, so a sharded policy can be gathered; a reward error may
        # stop one process only
        full_state = gathered_policy_state(run) if isinstance(err, NonFiniteError) else None
        note = save_last_good(
            run.health.last_good,
            step=run.state.global_step,
            loop_state=run.loop_state,
            output_dir=run.config.output_dir,
            writes=run.accelerator.is_main_process,
            write=lambda step, loop_state, rng: write_checkpoint(run, step, loop_state, rng, full_state),
        )
        err.args = (f"{err.args[0] if err.args else err}\n{note}", *err.args[1:])
        raise


def train_steps(run: TrainingRun, stops: StopSignals) -> dict[str, float]:
    config, state, accelerator = run.config, run.state, run.accelerator
    ga = run.plan.gradient_accumulation_steps
    logging_steps = resolve_steps(config.logging_steps, run.total_steps)
    save_steps = resolve_steps(config.save_steps, run.total_steps)
    if accelerator.is_main_process:
        os.makedirs(config.output_dir, exist_ok=True)  # metrics.jsonl, completions and checkpoints go there
    progress = tqdm(
        total=run.total_steps,
        initial=state.global_step,
        desc="grouprl",
        unit="step",
        disable=config.disable_tqdm or not accelerator.is_main_process,
    )
    run.progress = progress
    run.model.train()
    started, first_step = time.time(), state.global_step
    run.callbacks.control.should_training_stop = False  # a stop asked for in an earlier train() call is over
    epoch_open = False
    run.fire("on_train_begin")
    if config.eval_on_start and run.evaluates and state.global_step == 0:
        evaluate_and_track(run)
    while state.global_step < run.total_steps and not run.callbacks.control.should_training_stop:
        if not epoch_open:
            run.fire("on_epoch_begin")
            epoch_open = True
        step_started = time.perf_counter()
        run.health.start_step(state.global_step, run.loop_state(with_reference=False), run.window)
        # statistics of a step that did not finish (an error caught by the caller) are not this step's
        run.ledger.take()
        run.callbacks.new_step()
        run.fire("on_step_begin")
        step_loss = torch.zeros((), device=accelerator.device)
        for k in range(ga):
            if not run.pending:  # the next generation batch (TRL's dataloader batch)
                run.inputs = run.rollouts.draw_prompts()
            with accumulating(run, last=k == ga - 1):
                # prepare_inputs (generation when the buffer is empty) -> compute_loss -> backward (stages.py);
                # the stages' statistics go to run.ledger
                step_loss = step_loss + as_loss(stages.training_step(run, run.inputs), accelerator.device)
            if k < ga - 1:
                run.fire("on_substep_end")
        with run.timer.phase("optimizer"):
            grad_norm = clip_gradients(run)
            # one reduction of every statistic of the step; NaN / inf anywhere stops every process here,
            # before the update
            checked_norm = grad_norm if accelerator.scaler is None else None  # fp16 scaling skips inf steps by itself
            own = StepStats(loss=step_loss, grad_norm=checked_norm, stop_signal=float(stops.received))
            reduced = reduce_statistics(run, own)
            learning_rate = apply_update(run)
            grad_norm = update_norm(run, grad_norm)
        state.global_step += 1
        if config.torch_empty_cache_steps and state.global_step % config.torch_empty_cache_steps == 0:
            clear_device_cache()
        for entry in reduced[:-1]:  # the stages' entries, one per generation / micro-batch, as TRL appends them
            run.window.add_all(metrics(entry))
        end_of_step_updates(run, reduced)
        state.epoch = state.global_step / run.steps_per_epoch if run.steps_per_epoch else None
        loss = reduced[-1].loss
        run.step_losses.append(loss)
        run.window.add_all(
            {
                "loss": loss,
                "grad_norm": grad_norm,
                "learning_rate": learning_rate,
                "step_time": time.perf_counter() - step_started,
            }
        )
        step_stats = run.health.end_step(
            run.window,
            step=state.global_step,
            warn=accelerator.is_main_process,
            max_completion_length=config.max_completion_length,
            warmup=bool(config.warmup_steps),
        )
        control = run.fire("on_step_end")  # a callback may ask for a log, evaluation, checkpoint or stop at this step
        if should_log(config, state.global_step, logging_steps, run.steps_per_epoch) or control.should_log:
            trainer_level = {k: v for k, v in run.window.summary().items() if k in TRAINER_METRICS}
            stages.log(run, trainer_level)  # merges the GRPO metrics gathered since the last entry
        new_best = False
        if run.evaluates and (
            should_evaluate(config, state.global_step, run.total_steps, run.steps_per_epoch) or control.should_evaluate
        ):
            new_best = evaluate_and_track(run)
        saved = should_save(config, state.global_step, save_steps, run.steps_per_epoch, new_best) or control.should_save
        if saved:
            save(run)
        progress.update(1)
        if reduced[-1].stop_signal:  # a process was sent SIGINT / SIGTERM (stop_signals.py): all stop here
            progress.close()
            stop_on_signal(run, int(reduced[-1].stop_signal), saved)
        if postfix := progress_postfix(step_stats):
            progress.set_postfix(postfix, refresh=False)
        if (
            (run.steps_per_epoch and state.global_step % run.steps_per_epoch == 0)
            or state.global_step >= run.total_steps
            or run.callbacks.control.should_training_stop
        ):
            run.fire("on_epoch_end")
            epoch_open = False
    progress.close()
    run.progress = None
    run.health.finish()
    if config.load_best_model_at_end and state.best_model_checkpoint is not None:
        run.accelerator.wait_for_everyone()
        load_policy_weights(accelerator.unwrap_model(run.model), state.best_model_checkpoint)

    run.store_flos()
    metrics_ = train_summary(run, time.time() - started, state.global_step - first_step)
    stages.log(run, metrics_)  # as Trainer: adds epoch, and GRPO merges the metrics of steps not logged yet
    run.fire("on_train_end")
    return metrics_


def stop_on_signal(run: TrainingRun, number: int, saved: bool) -> None:
    """Checkpoint (a collective; unless this step just did), say how to resume, exit with 128 + the signal's
    number."""
    if not saved:
        save(run)
    if run.accelerator.is_main_process:
        path = os.path.join(run.config.output_dir, f"checkpoint-{run.state.global_step}")
        print(resume_hint(path, number, run.state.global_step), file=sys.stderr, flush=True)
    raise SystemExit(exit_code(number))


def train_summary(run: TrainingRun, runtime: float, steps_done: int) -> dict[str, float]:
    """Trainer's end-of-training metrics: speed (rounded as transformers' speed_metrics), total_flos, train_loss."""
    steps = max(steps_done, 1)
    return {
        "train_runtime": round(runtime, 4),
        "train_samples_per_second": round(steps * run.plan.completions_per_optimizer_step / max(runtime, 1e-9), 3),
        "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
        "total_flos": run.state.total_flos,
        "train_loss": sum(run.step_losses) / max(len(run.step_losses), 1),
    }


def should_log(config: GRPOConfig, step: int, logging_steps: int, steps_per_epoch: Optional[int]) -> bool:
    return (config.logging_first_step and step == 1) or interval_due(
        config.logging_strategy, step, logging_steps, steps_per_epoch
    )


def evaluate_and_track(run: TrainingRun) -> bool:
    """Evaluate (logged by the evaluation itself); True when metric_for_best_model reached a new best."""
    override = run.overrides.get("evaluate")  # a TRL override point
    metrics = override() if override else evaluation.evaluate(stages.evaluation_parts(run), run.eval_dataset)
    return record_evaluation(run.config, run.state, metrics or {})
