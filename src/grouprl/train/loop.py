"""The GRPO training loop, top to bottom.

    until max steps:
        for each micro-batch of the step (gradient_accumulation_steps; an epoch's last step takes those left):
            if no micro-batch is buffered: draw the next generation's prompts (the `inputs` rows)
            training_step(inputs)                                                   (stages.py)
                prepare_inputs: if no micro-batch is buffered:
                    generate_and_score: generate -> score -> advantages
                        -> (old / reference logprobs, sampler IS weights)  (rollout/experience.py)
                        -> TrainBatch, ExperienceStats (recorded in run.ledger)
                    -> shuffle rows -> split into steps_per_generation micro-batches,
                       queued num_iterations times
                compute_loss: forward -> policy loss (micro_step.py) -> loss, LossStats (run.ledger)
                -> backward
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

Below the loop's own functions come the parts of its optimizer step, in the order it runs them (backward, per
micro-batch, is the last stage of training_step: stages.py):

    clip_gradients          max_grad_norm; the norm before clipping
    reduce_statistics       every statistic of the step over every process, once; NaN / inf anywhere stops all
    apply_update            optimizer step, then the LR schedule
    end_of_step_updates     the controllers that act once per step: entropy coefficient, TR-DPO reference sync

None of them reads the host value of a tensor before `reduce_statistics`: one sync per step.

The buffer semantics are TRL's (§2.13): one generation feeds steps_per_generation x num_iterations
micro-steps, replayed in the same order each iteration, independently of where optimizer steps
fall. Everything needed to continue exactly (sampler position, buffered micro-batches, RNG) is in
`loop_state` and saved with each checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from accelerate.utils.memory import clear_device_cache
from tqdm.auto import tqdm
from transformers.utils import logging

from grouprl.core.distributed import gather_objects
from grouprl.core.metrics import TRAINER_METRICS, progress_postfix
from grouprl.core.stats import finite, largest, mean, metrics
from grouprl.data.prompts import DataRowError
from grouprl.model.full_state import fsdp_sharded
from grouprl.model.reference import mix_into_reference
from grouprl.rewards.scoring import RewardFunctionError
from grouprl.train import evaluation, stages
from grouprl.train.best_checkpoint import record_evaluation
from grouprl.train.checkpoint import SaveFailed, load_policy_weights
from grouprl.train.default_flow import step_end
from grouprl.train.last_good_state import save_last_good
from grouprl.train.non_finite import NonFiniteError, non_finite_error
from grouprl.train.run_checkpoints import gathered_policy_state, save, write_checkpoint
from grouprl.train.step_reduction import reduce_step
from grouprl.train.stop_signals import StoppedAtOnce, StopSignals, exit_code, resume_hint
from grouprl.train.training_run import TrainingRun, deepspeed_engine

logger = logging.get_logger("grouprl")


def train(run: TrainingRun) -> dict[str, float]:
    """Train to max_steps; on NaN / inf, a failing reward function or a bad row, save the last good state, then re-raise
    the error with where that state is."""
    describe = lambda: f"step {run.state.global_step + 1}"  # noqa: E731 - read when a signal arrives
    try:
        with StopSignals(describe, announce=run.accelerator.is_main_process) as stops:
            return train_steps(run, stops)
    except StoppedAtOnce as err:
        # An explicit exit status: Python's own for an uncaught KeyboardInterrupt (130) turns into 1 once
        # torch._dynamo is imported (a checkpoint's optimizer.state_dict imports it; torch 2.13's exit handler
        # then imports a module, which clears the interpreter's record of the interrupt).
        print(f"grouprl: {err}. {save_at_once(run)}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code(signal.SIGINT)) from err
    except (NonFiniteError, RewardFunctionError, DataRowError) as err:
        # every process raises the same NonFiniteError, so a sharded policy can be gathered; a reward error or a
        # bad row may stop one process only
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


def save_at_once(run: TrainingRun) -> str:
    """A second Ctrl-C stopped the step in flight wherever it was (a hung reward, generation): save the last
    completed step, as a failing step does; not while the update was being applied (the weights may be half
    updated) nor where writing it needs the other processes (a sharded policy). Says what was saved."""
    sharded = deepspeed_engine(run.accelerator) is not None or fsdp_sharded(run.accelerator.unwrap_model(run.model))
    if run.updating or sharded:
        why = "its update was being applied" if run.updating else "a sharded policy is written by every process"
        return f"No checkpoint is written ({why}); the last one stands."
    return save_last_good(
        run.health.last_good,
        step=run.state.global_step,
        loop_state=run.loop_state,
        output_dir=run.config.output_dir,
        writes=run.accelerator.is_main_process,
        write=lambda step, loop_state, rng: write_checkpoint(run, step, loop_state, rng),
    )


def train_steps(run: TrainingRun, stops: StopSignals) -> dict[str, float]:
    config, state, accelerator = run.config, run.state, run.accelerator
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
    run.session_start = (started, state.num_input_tokens_seen)
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
        # gradient_accumulation_steps, or what is left of the epoch in its last step (batch_plan.py)
        ga = run.accumulation_steps = run.plan.micro_batches_in_step(state.global_step, run.micro_steps_per_epoch)
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
            run.updating = True
            learning_rate = apply_update(run)
            grad_norm = update_norm(run, grad_norm)
        state.global_step += 1
        if config.torch_empty_cache_steps and state.global_step % config.torch_empty_cache_steps == 0:
            clear_device_cache()
        for entry in reduced[:-1]:  # the stages' entries, one per generation / micro-batch, as TRL appends them
            run.window.add_all(metrics(entry))
        end_of_step_updates(run, reduced)
        run.updating = False
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
        flow = step_end(config, state.global_step, run.total_steps, run.steps_per_epoch, control.should_training_stop)
        if flow.log or control.should_log:
            trainer_level = {k: v for k, v in run.window.summary().items() if k in TRAINER_METRICS}
            stages.log(run, trainer_level)  # merges the GRPO metrics gathered since the last entry
        new_best = run.evaluates and (flow.evaluate or control.should_evaluate) and evaluate_and_track(run)
        saved = flow.save or control.should_save or (config.save_strategy == "best" and new_best)
        if saved:
            saved = save_or_go_on(run)
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
    if run.rollouts.completion_log is not None:
        run.rollouts.completion_log.finish()
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


def save_or_go_on(run: TrainingRun) -> bool:
    """Checkpoint the run; when that fails (SaveFailed: its partial files are gone), stop with the error, or with
    save_failure='continue' log it and train on. True when a checkpoint was written."""
    try:
        save(run)
    except SaveFailed as err:
        if run.config.save_failure != "continue":
            raise
        if run.accelerator.is_main_process:
            logger.warning(
                f"grouprl: {err} Training goes on (save_failure='continue'); the next checkpoint tries again."
            )
        return False
    return True


def evaluate_and_track(run: TrainingRun) -> bool:
    """Evaluate (logged by the evaluation itself); True when metric_for_best_model reached a new best."""
    override = run.overrides.get("evaluate")  # a TRL override point
    metrics = override() if override else evaluation.evaluate(stages.evaluation_parts(run), run.eval_dataset)
    return record_evaluation(run.config, run.state, metrics or {})


# ---- the parts of one optimizer step, in the order the loop runs them -------------------------------------------


@dataclass(frozen=True)
class StepStats:
    """The loop's own statistics of an optimizer step."""

    loss: Any = mean("loss")  # this process's summed micro-batch losses; logged as the mean over processes
    # the clipped-over norm: NaN / inf stops every process (None under fp16 scaling)
    grad_norm: Any = finite("gradients")
    # the number of a SIGINT / SIGTERM a process received (0: none): every process learns it (stop_signals.py)
    stop_signal: Any = largest(None)


@contextmanager
def accumulating(run: TrainingRun, last: bool) -> Iterator[None]:
    """The scope of one micro-batch of the step. grouprl accumulates gradients itself (accelerate's accumulation is
    1 step): DDP all-reduces them only in the last micro-batch; DeepSpeed is told whether it is the boundary."""
    engine = deepspeed_engine(run.accelerator)
    if engine is not None:
        engine.set_gradient_accumulation_boundary(last)
        yield
    elif last:
        yield
    else:
        with run.accelerator.no_sync(run.model):
            yield


def as_loss(value: Any, device: torch.device) -> torch.Tensor:
    """training_step's result (TRL: a detached tensor; an override may return a number) as a 0-dim tensor."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), device=device)


def clip_gradients(run: TrainingRun) -> Optional[torch.Tensor]:
    """Clip to max_grad_norm; returns the norm before clipping (a tensor: read once the step is reduced). None under
    DeepSpeed, which clips inside its step (the config's gradient_clipping, max_grad_norm by default): its norm is
    read after the update (update_norm)."""
    if deepspeed_engine(run.accelerator) is not None:
        return None
    params = [p for p in run.model.parameters() if p.requires_grad]
    max_norm = run.config.max_grad_norm if run.config.max_grad_norm > 0 else float("inf")
    norm = run.accelerator.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a replicated DTensor
        norm = norm.full_tensor()
    return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))


def reduce_statistics(run: TrainingRun, step_stats: StepStats) -> list[Any]:
    """Every statistic of this optimizer step, over every process, in one reduction; raises the same
    NonFiniteError on every process if any process saw a NaN / inf (before the update). Returns the reduced
    entries, step_stats last."""
    run.ledger.record(step_stats)
    reduced, failures = reduce_step(run.ledger.take(), run.collectives)
    if failures:
        raise non_finite_error(
            failures,
            step=run.state.global_step + 1,
            process_index=run.accelerator.process_index,
            num_processes=run.accelerator.num_processes,
            gather=gather_objects,
        )
    return reduced


def apply_update(run: TrainingRun) -> float:
    """Optimizer step, then schedule; returns the learning rate used."""
    learning_rate = run.scheduler.get_last_lr()[0]
    run.fire("on_pre_optimizer_step")
    engine = deepspeed_engine(run.accelerator)
    if engine is None:
        run.optimizer.step()
    else:  # reduces the accumulated gradients, clips, steps and zeroes them
        engine.step()
    run.fire("on_optimizer_step")
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return learning_rate


def update_norm(run: TrainingRun, clipped_norm: Optional[torch.Tensor]) -> float:
    """The step's gradient norm before clipping: clip_gradients', or DeepSpeed's from its step."""
    if clipped_norm is not None:
        return float(clipped_norm)
    norm = deepspeed_engine(run.accelerator).get_global_grad_norm()
    return float("nan") if norm is None else float(norm)


def end_of_step_updates(run: TrainingRun, reduced: list[Any]) -> None:
    """Controllers that act once per optimizer step: the entropy coefficient (from the step's reduced entropy
    sums), the TR-DPO reference sync, the weights of an asynchronous generation worker."""
    controller, accelerator = run.entropy_controller, run.accelerator
    source, step = run.rollouts.source, run.state.global_step
    if source is not None and step % run.config.weight_sync_steps == 0:
        source.publish(accelerator.unwrap_model(run.model), step)
    if controller is not None:
        total = sum(getattr(entry, "entropy_sum", None) or 0.0 for entry in reduced)
        count = sum(getattr(entry, "entropy_count", None) or 0.0 for entry in reduced)
        run.window.add("entropy_coef", controller.end_step(total, count))
    if run.config.sync_ref_model and run.state.global_step % run.config.ref_model_sync_steps == 0:
        mix_into_reference(run.reference.model, accelerator.unwrap_model(run.model), run.config.ref_model_mixup_alpha)
