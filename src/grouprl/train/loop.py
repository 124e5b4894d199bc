"""The GRPO training loop, top to bottom.

    until max steps:
        for each of gradient_accumulation_steps micro-batches:
            if no micro-batch is buffered: draw the next generation's prompts (the `inputs` rows)
            trainer.training_step(model, inputs)
                trainer._prepare_inputs(inputs): if no micro-batch is buffered:
                    trainer._generate_and_score_completions(inputs): generate -> score ->
                        advantages -> (old / reference logprobs, sampler IS weights)  (experience.py)
                        -> TrainBatch, ExperienceStats (recorded in run.ledger)
                    -> shuffle rows -> split into steps_per_generation micro-batches,
                       queued num_iterations times
                trainer.compute_loss -> _compute_loss: forward -> policy loss    (objective.py)
                    -> loss, LossStats (recorded in run.ledger)
                -> backward
        clip gradients -> reduce the step's statistics over every process, once (step_reduction.py;
        a NaN / inf anywhere stops every process here) -> optimizer step -> LR step
        -> statistics into the metric window -> entropy controller / reference sync
        -> trainer.log -> evaluate -> checkpoint
    trainer.log(train summary) -> on_train_end
    (TrainerCallback events fire at the same points as in transformers' Trainer: callbacks.py)

The `trainer.*` methods are TRL's override points (trainer_hooks.py): a TRL subclass's versions run,
and their defaults are the grouprl stages named on the right. The stages get what they use (the
model, the batch, `Objective`, `Sampling`), never the run; this module is the only one that holds it.

The buffer semantics are TRL's (§2.13): one generation feeds steps_per_generation x num_iterations
micro-steps, replayed in the same order each iteration, independently of where optimizer steps
fall. Everything needed to continue exactly (sampler position, buffered micro-batches, RNG) is in
`loop_state` and saved with each checkpoint.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils.memory import clear_device_cache
from tqdm.auto import tqdm

from grouprl.config.grpo_config import BatchPlan, GRPOConfig, interval_due, resolve_steps
from grouprl.core.distributed import gather_objects, global_sum
from grouprl.core.entropy import EntropyController
from grouprl.core.metrics import TRAINER_METRICS, JsonlWriter, MetricWindow, PhaseTimer, progress_postfix
from grouprl.core.stats import finite, mean, metrics
from grouprl.data.generation_inputs import GenerationInputs
from grouprl.model.reference import Reference, mix_into_reference
from grouprl.rewards.scoring import RewardFunctionError
from grouprl.rollout.experience import Sampling
from grouprl.rollout.sampler import RolloutMaker
from grouprl.train.best_checkpoint import record_evaluation
from grouprl.train.callbacks import CallbackHandler
from grouprl.train.checkpoint import load_policy_weights, rng_state, save_checkpoint
from grouprl.train.evaluation import EvaluationParts, should_evaluate
from grouprl.train.health import NonFiniteError, RunHealth, non_finite_error, save_last_good
from grouprl.train.micro_step import Objective
from grouprl.train.step_reduction import Collectives, StepLedger, reduce_step


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
    objective: Objective  # the loss's settings, built once from the config
    reference: Optional[Reference] = None  # beta != 0
    entropy_controller: Optional[EntropyController] = None  # entropy bonus on
    window: MetricWindow = field(default_factory=MetricWindow)
    ledger: StepLedger = field(default_factory=StepLedger)  # the stages' statistics of the current optimizer step
    pending: deque = field(default_factory=deque)  # micro-batches (TrainBatch) not yet trained on
    evaluates: bool = (
        False  # trainer.evaluate() may run during training (eval_strategy != "no" or there is an eval set)
    )
    step_losses: list[float] = field(default_factory=list)
    health: RunHealth = field(default_factory=RunHealth)  # detectors, NaN guards, last good state (health.py)
    callbacks: CallbackHandler = field(default_factory=CallbackHandler)  # the user's TrainerCallbacks
    trainer: Any = None  # the GRPOTrainer: its TRL override points (training_step, log, ...) drive the loop
    inputs: Optional[GenerationInputs] = None  # the generation batch the buffered micro-batches come from
    progress: Any = None  # the tqdm bar while training (log lines are written through it)
    flos: float = 0.0  # this process's floating-point operations not yet added to state.total_flos
    evaluation_pass: Any = None  # set while evaluating: the eval RolloutMaker and metric window (evaluation.py)
    collectives: Collectives = field(init=False)  # the step's reductions over the processes (from the accelerator)
    trained_tokens: Any = field(
        init=False, default=0.0
    )  # tokens trained on since the last store_flos (a tensor: no host sync)
    _flos_per_token: Optional[float] = field(init=False, default=None)

    def fire(self, event: str, **extra: Any) -> Any:
        """Call a TrainerCallback event on every callback; returns the shared TrainerControl."""
        return self.callbacks.fire(event, self.config, self.state, **extra)

    def publish(self, values: dict[str, Any]) -> dict[str, Any]:
        """One log entry (a training step's or an evaluation's) at the current step: log_history, the
        report_to trackers (numbers only, NaN left out) and the callbacks' on_log. Returns the entry."""
        entry = {**values, "epoch": self.state.epoch, "step": self.state.global_step}
        self.state.log_history.append(entry)
        numbers = {
            k: v
            for k, v in entry.items()
            if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
        }
        self.accelerator.log(numbers, step=self.state.global_step)
        self.fire("on_log", logs=entry)
        return entry

    def echo(self, entry: dict[str, Any], line: Optional[str]) -> None:
        """A published log entry to output_dir/metrics.jsonl and, if given, a console line (main process)."""
        if not self.accelerator.is_main_process:
            return
        JsonlWriter(os.path.join(self.config.output_dir, "metrics.jsonl")).write(entry)
        if line is None:
            return
        if self.progress is not None and not self.progress.disable:
            self.progress.write(line)
        else:
            print(line, flush=True)

    def count_flos(self, micro: Any) -> None:
        """Count a micro-batch's tokens for the training flos (6 x tokens x non-embedding parameters, transformers' estimate)."""
        self.trained_tokens = self.trained_tokens + micro.prompt_mask.sum() + micro.completion_mask.sum()

    def store_flos(self) -> None:
        """Add every process's counted flos to state.total_flos (as Trainer.store_flos)."""
        if self._flos_per_token is None:
            model = self.accelerator.unwrap_model(self.model)
            try:
                parameters = model.num_parameters(exclude_embeddings=True)
            except (AttributeError, TypeError):
                parameters = sum(p.numel() for p in model.parameters())
            self._flos_per_token = 6 * parameters
        self.flos += self._flos_per_token * float(self.trained_tokens)
        self.trained_tokens = 0.0
        self.state.total_flos += global_sum(self.accelerator, self.flos)
        self.flos = 0.0

    def __post_init__(self) -> None:
        self.collectives = Collectives.of(self.accelerator)

    def evaluation_parts(self) -> EvaluationParts:
        """What evaluation (evaluation.evaluate) uses of the run."""
        return EvaluationParts(
            self.config,
            self.accelerator,
            self.model,
            self.rollouts,
            self.trainer,
            self.state,
            self.fire,
            attach=lambda current: setattr(self, "evaluation_pass", current),
        )

    def sampling(self) -> Sampling:
        """What the generation stage (experience.score_generation) uses of the run."""
        return Sampling(self.rollouts, self.config, self.plan, self.accelerator, self.state, self.window, self.timer)

    @property
    def timer(self) -> PhaseTimer:
        return PhaseTimer(self.window)

    def loop_state(self, with_reference: bool = True) -> dict[str, Any]:
        state = {
            "sampler": self.rollouts.sampler.state_dict(),
            "pending": list(self.pending),
            "generations_made": self.rollouts.generations_made,
            "tokens_seen": self.rollouts.tokens_seen,
            "step_losses": list(self.step_losses),
            "window": {k: list(v) for k, v in self.window.values.items()},
            "entropy_controller": self.entropy_controller.state_dict() if self.entropy_controller else None,
            "inputs": self.inputs,
        }
        if with_reference:  # a copy of a whole model: only when writing a checkpoint
            state["reference_model"] = (
                self.reference.state_dict() if self.reference and self.config.sync_ref_model else None
            )
        return state

    def load_loop_state(self, state: dict[str, Any]) -> None:
        self.rollouts.sampler.load_state_dict(state["sampler"])
        self.pending = deque(state["pending"])
        self.inputs = state.get("inputs")
        self.rollouts.generations_made = state["generations_made"]
        self.rollouts.tokens_seen = state["tokens_seen"]
        self.step_losses = list(state["step_losses"])
        self.window.clear()
        for name, values in state["window"].items():
            self.window.values[name].extend(values)
        if self.entropy_controller is not None and state.get("entropy_controller"):
            self.entropy_controller.load_state_dict(state["entropy_controller"])
        if self.reference is not None:
            self.reference.load_state_dict(state.get("reference_model"))


@dataclass(frozen=True)
class StepStats:
    """The loop's own statistics of an optimizer step."""

    loss: Any = mean("loss")  # this process's summed micro-batch losses; logged as the mean over processes
    grad_norm: Any = finite(
        "gradients"
    )  # the clipped-over norm: NaN / inf stops every process (None under fp16 scaling)


def train_micro_batch(run: TrainingRun, micro: Any) -> torch.Tensor:
    """Loss (trainer.compute_loss) and backward of one micro-batch; returns the (GA-scaled) loss, detached (no host sync)."""
    if len(micro) == 0:  # dynamic sampling kept fewer rows than micro-steps
        return torch.zeros((), device=run.accelerator.device)
    loss = run.trainer.compute_loss(run.model, micro)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"{type(run.trainer).__name__}.compute_loss must return the loss as a one-element tensor, got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
        )
    with run.timer.phase("backward"):
        run.accelerator.backward(loss)
    run.count_flos(micro)
    return loss.detach().reshape(())


def clip_gradients(run: TrainingRun) -> torch.Tensor:
    """Clip to max_grad_norm; returns the norm before clipping (a tensor: read once the step is reduced)."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    max_norm = run.config.max_grad_norm if run.config.max_grad_norm > 0 else float("inf")
    norm = run.accelerator.clip_grad_norm_(params, max_norm)
    return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm))


def reduce_statistics(run: TrainingRun, step_stats: StepStats) -> list[Any]:
    """Every statistic of this optimizer step, over every process, in one reduction; raises the same NonFiniteError on
    every process if any process saw a NaN / inf (before the update). Returns the reduced entries, step_stats last."""
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
    run.optimizer.step()
    run.fire("on_optimizer_step")
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return learning_rate


def _as_loss(value: Any, device: torch.device) -> torch.Tensor:
    """training_step's result (TRL: a detached tensor; an override may return a number) as a 0-dim tensor."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(value), device=device)


def train(run: TrainingRun) -> dict[str, float]:
    """Train to max_steps; on NaN / inf or a failing reward function, save the last good state, then re-raise the error
    with where that state is."""
    try:
        return train_steps(run)
    except (NonFiniteError, RewardFunctionError) as err:
        note = save_last_good(
            run.health.last_good,
            step=run.state.global_step,
            loop_state=run.loop_state,
            output_dir=run.config.output_dir,
            writes=run.accelerator.is_main_process,
            write=lambda step, loop_state, rng: write_checkpoint(run, step, loop_state, rng),
        )
        err.args = (f"{err.args[0] if err.args else err}\n{note}", *err.args[1:])
        raise


def train_steps(run: TrainingRun) -> dict[str, float]:
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
        run.ledger.take()  # statistics of a step that did not finish (an error caught by the caller) are not this step's
        run.callbacks.new_step()
        run.fire("on_step_begin")
        step_loss = torch.zeros((), device=accelerator.device)
        for k in range(ga):
            if not run.pending:  # the next generation batch (TRL's dataloader batch)
                run.inputs = run.rollouts.draw_prompts()
            with nullcontext() if k == ga - 1 else accelerator.no_sync(run.model):
                # training_step -> _prepare_inputs (generation: experience.py) -> compute_loss (objective.py) -> backward;
                # the stages' statistics go to run.ledger
                step_loss = step_loss + _as_loss(
                    run.trainer.training_step(run.model, run.inputs, None), accelerator.device
                )
            if k < ga - 1:
                run.fire("on_substep_end")
        with run.timer.phase("optimizer"):
            grad_norm = clip_gradients(run)
            # one reduction of every statistic of the step; NaN / inf anywhere stops every process here, before the update
            checked_norm = grad_norm if accelerator.scaler is None else None  # fp16 scaling skips inf steps by itself
            reduced = reduce_statistics(run, StepStats(loss=step_loss, grad_norm=checked_norm))
            learning_rate = apply_update(run)
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
                "grad_norm": float(grad_norm),
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
            run.trainer.log(trainer_level)  # GRPOTrainer.log merges the GRPO metrics gathered since the last entry
        new_best = False
        if run.evaluates and (
            should_evaluate(config, state.global_step, run.total_steps, run.steps_per_epoch) or control.should_evaluate
        ):
            new_best = evaluate_and_track(run)
        if should_save(config, state.global_step, save_steps, run.steps_per_epoch, new_best) or control.should_save:
            save(run)
        progress.update(1)
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
    run.trainer.log(metrics_)  # as Trainer: adds epoch, and GRPO merges the metrics of steps not logged yet
    run.fire("on_train_end")
    return metrics_


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


def end_of_step_updates(run: TrainingRun, reduced: list[Any]) -> None:
    """Controllers that act once per optimizer step: the entropy coefficient (from the step's reduced entropy sums),
    the TR-DPO reference sync."""
    controller, accelerator = run.entropy_controller, run.accelerator
    if controller is not None:
        total = sum(getattr(entry, "entropy_sum", None) or 0.0 for entry in reduced)
        count = sum(getattr(entry, "entropy_count", None) or 0.0 for entry in reduced)
        run.window.add("entropy_coef", controller.end_step(total, count))
    if run.config.sync_ref_model and run.state.global_step % run.config.ref_model_sync_steps == 0:
        mix_into_reference(run.reference.model, accelerator.unwrap_model(run.model), run.config.ref_model_mixup_alpha)


def should_log(config: GRPOConfig, step: int, logging_steps: int, steps_per_epoch: Optional[int]) -> bool:
    return (config.logging_first_step and step == 1) or interval_due(
        config.logging_strategy, step, logging_steps, steps_per_epoch
    )


def evaluate_and_track(run: TrainingRun) -> bool:
    """Evaluate (logged by the evaluation itself); True when metric_for_best_model reached a new best."""
    metrics = run.trainer.evaluate()  # a TRL override point
    return record_evaluation(run.config, run.state, metrics or {})


def should_save(
    config: GRPOConfig, step: int, save_steps: int, steps_per_epoch: Optional[int], new_best: bool = False
) -> bool:
    if config.save_strategy == "best":
        return new_best
    return interval_due(config.save_strategy, step, save_steps, steps_per_epoch)


def save(run: TrainingRun) -> Optional[str]:
    """Checkpoint the run (main process writes; all processes wait for it)."""
    run.accelerator.wait_for_everyone()
    path = None
    # every process's RNG and buffered micro-batches (the loop state below is the main process's)
    processes = (
        gather_objects({"rng": rng_state(), "pending": list(run.pending), "inputs": run.inputs})
        if run.accelerator.num_processes > 1
        else None
    )
    run.store_flos()
    if run.state.best_global_step == run.state.global_step and run.state.best_metric is not None:
        run.state.best_model_checkpoint = os.path.join(run.config.output_dir, f"checkpoint-{run.state.global_step}")
    if run.accelerator.is_main_process:
        path = save_checkpoint(
            run.config.output_dir,
            run.state.global_step,
            model=run.accelerator.unwrap_model(run.model),
            tokenizer=run.tokenizer,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            trainer_state=run.state,
            loop_state={**run.loop_state(), "processes": processes},
            save_total_limit=run.config.save_total_limit,
            model_only=run.config.save_only_model,
            keep=run.state.best_model_checkpoint,
        )
    run.accelerator.wait_for_everyone()
    run.fire("on_save")
    return path


def write_checkpoint(run: TrainingRun, step: int, loop_state: dict[str, Any], rng: Optional[dict[str, Any]]) -> None:
    """Write a checkpoint of the run at `step` with the given loop state and RNG (the last good state after a failure)."""
    save_checkpoint(
        run.config.output_dir,
        step,
        model=run.accelerator.unwrap_model(run.model),
        tokenizer=run.tokenizer,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        trainer_state=run.state,
        loop_state=loop_state,
        save_total_limit=run.config.save_total_limit,
        rng=rng,
    )
