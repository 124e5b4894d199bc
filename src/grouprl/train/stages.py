"""The stages of one micro-step, in TRL's order; at each of TRL's override points the user's version runs if a
GRPOTrainer subclass defines one (run.overrides, core/overrides.py), else grouprl's own stage, called directly.

    training_step(inputs)          prepare_inputs -> compute_loss -> backward            (own_training_step)
      prepare_inputs(inputs)       the next buffered micro-batch; an empty buffer is refilled from one
                                   generation: shuffled, cut into steps_per_generation micro-batches, queued
                                   num_iterations times                                  (own_prepare_inputs)
        generate_and_score(inputs) generate -> rewards -> advantages -> old / reference logprobs
                                   (rollout/experience.py; eval mode: eval_mode.eval_batch)
      compute_loss(micro)          -> _compute_loss: the GRPO loss (micro_step.py; eval mode: eval_mode.eval_loss)
      backward(loss)               accelerate's (DeepSpeed's) backward; counts the micro-batch's tokens for the flos
    log(logs)                      log_history, trackers, on_log, metrics.jsonl, a console line (own_log)

GRPOTrainer's methods of the same names (compat/override_points.py) call the `own_*` stages, so a user's
override that calls ``super()`` continues down grouprl's chain, through the user's other overrides.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from grouprl.core.metrics import TRAINER_METRICS, format_log_line
from grouprl.core.types import TrainBatch
from grouprl.data.prompt_sampler import GenerationInputs
from grouprl.rollout import experience
from grouprl.train import eval_mode, micro_step
from grouprl.train.evaluation import EvaluationParts, format_eval_line
from grouprl.train.training_run import TrainingRun, deepspeed_engine


def training_step(run: TrainingRun, inputs: GenerationInputs) -> Any:
    """One micro-step: the user's training_step, else own_training_step. Returns the detached loss (an override may
    return a number)."""
    override = run.overrides.get("training_step")
    return override(run.model, inputs, None) if override else own_training_step(run, inputs)


def own_training_step(run: TrainingRun, inputs: GenerationInputs) -> torch.Tensor:
    """prepare_inputs -> compute_loss -> backward; the (GA-scaled) loss, detached, with no host sync."""
    micro = prepare_inputs(run, inputs)
    if len(micro) == 0:  # dynamic sampling kept fewer rows than micro-steps
        return torch.zeros((), device=run.accelerator.device)
    loss = compute_loss(run, micro)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"{run.overrides.qualified('compute_loss')} must return the loss as a one-element tensor, got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
        )
    backward(run, loss, micro)
    return loss.detach().reshape(())


def prepare_inputs(run: TrainingRun, inputs: GenerationInputs) -> Any:
    override = run.overrides.get("_prepare_inputs")
    return override(inputs) if override else own_prepare_inputs(run, inputs)


def own_prepare_inputs(run: TrainingRun, inputs: GenerationInputs) -> Any:
    """Training: the next buffered micro-batch, generating when the buffer is empty. Evaluation (model in eval
    mode): the generation batch itself, as TRL."""
    if not run.model.training:
        return generate_and_score(run, inputs)
    if not run.pending:
        batch = generate_and_score(run, inputs)
        if not isinstance(batch, TrainBatch):
            raise TypeError(
                f"{run.overrides.qualified('_generate_and_score_completions')} must return the grouprl TrainBatch "
                f"its super() returned (it takes TRL's keys: batch['advantages'] = ...), got {type(batch).__name__}."
            )
        config = run.config
        run.pending.extend(
            experience.split_generation(
                batch, run.plan, loss_type=config.loss_type, top_entropy_quantile=config.top_entropy_quantile
            )
        )
        run.state.num_input_tokens_seen = run.rollouts.tokens_seen
    return run.pending.popleft().to(run.accelerator.device)


def generate_and_score(run: TrainingRun, inputs: GenerationInputs) -> Any:
    override = run.overrides.get("_generate_and_score_completions")
    return override(inputs) if override else own_generate_and_score(run, inputs)


def own_generate_and_score(run: TrainingRun, inputs: GenerationInputs) -> TrainBatch:
    """One generation batch made ready to train on: completions for `inputs` (each row a completion to sample),
    rewards, advantages and (training) the old / reference logprobs and sampler weights it needs."""
    if not isinstance(inputs, GenerationInputs) or inputs.prompt_batch is None:
        raise TypeError(
            f"_generate_and_score_completions needs the generation batch grouprl passed to training_step / "
            f"_prepare_inputs (a grouprl GenerationInputs), got {type(inputs).__name__}; pass it on unchanged."
        )
    if not run.model.training:
        return eval_mode.eval_batch(run.evaluation_pass, inputs, accelerator=run.accelerator, trainer_state=run.state)
    batch, stats = experience.score_generation(
        run.sampling(), run.model, inputs, overrides=run.overrides, reference=run.reference
    )
    run.ledger.record(stats)  # reduced with the rest of the optimizer step's statistics (loop.py)
    return batch


def compute_loss(run: TrainingRun, micro: Any) -> Any:
    override = run.overrides.get("compute_loss")
    return override(run.model, micro) if override else own_compute_loss(run, run.model, micro)


def own_compute_loss(run: TrainingRun, model: torch.nn.Module, micro: Any) -> torch.Tensor:
    override = run.overrides.get("_compute_loss")
    return override(model, micro) if override else own_policy_loss(run, micro)


def own_policy_loss(run: TrainingRun, micro: Any) -> torch.Tensor:
    """Training: the GRPO loss of the micro-batch, scaled for gradient accumulation, its statistics recorded.
    Evaluation: the policy loss at ratio 1, without KL."""
    if not run.model.training:
        return eval_mode.eval_loss(
            run.model,
            micro,
            run.objective,
            evaluation_pass=run.evaluation_pass,
            accelerator=run.accelerator,
            rows_per_chunk=run.config.per_device_eval_batch_size,
            overrides=run.overrides,
        )
    controller = run.entropy_controller
    loss, stats = micro_step.micro_batch_loss(
        run.model,
        micro,
        run.objective,
        accelerator=run.accelerator,
        accumulation_steps=run.accumulation_steps,
        overrides=run.overrides,
        timer=run.timer,
        entropy_coef=controller.applied_coef() if controller is not None else None,
    )
    run.ledger.record(stats)  # reduced with the rest of the optimizer step's statistics (loop.py)
    return loss


def backward(run: TrainingRun, loss: torch.Tensor, micro: Any) -> None:
    """Backward of one micro-batch's (GA-scaled) loss; counts its tokens for the flos."""
    run.before_backward()
    engine = deepspeed_engine(run.accelerator)
    with run.timer.phase("backward"):
        if engine is None:
            run.accelerator.backward(loss)
        else:  # the loss is already divided by the accumulation steps; accelerate's wrapper would step every time
            engine.backward(loss, scale_wrt_gas=False)
    run.count_flos(micro)


def log(run: TrainingRun, logs: dict[str, Any]) -> None:
    override = run.overrides.get("log")
    if override:
        override(logs)
    else:
        own_log(run, logs)


def own_log(run: TrainingRun, logs: dict[str, Any], start_time: Optional[float] = None) -> None:
    """Log `logs`: log_history (with epoch and step), the report_to trackers, the callbacks' on_log, metrics.jsonl
    and a console line. While the model is in training mode (TRL's GRPO), the metrics gathered since the last
    entry are merged in first (means, NaN left out; None when nothing valid) and the completion log is written
    when log_completions is on. `logs` is updated in place, as Trainer's (``epoch`` added)."""
    config, state = run.config, run.state
    training = run.model.training
    if training:
        logs.update({name: value for name, value in run.window.summary().items() if name not in TRAINER_METRICS})
        run.window.clear()
    if state.epoch is not None:
        logs["epoch"] = state.epoch
    if config.include_num_input_tokens_seen not in (False, "no"):  # as transformers' Trainer.log
        logs["num_input_tokens_seen"] = state.num_input_tokens_seen
        since, tokens = run.session_start or (start_time, state.num_input_tokens_seen)
        now = time.time()
        if training and since is not None and "train_runtime" not in logs and now > since:
            logs["train_tokens_per_second"] = round((state.num_input_tokens_seen - tokens) / (now - since), 3)
    entry = run.publish(logs)
    if "train_runtime" in entry:  # the end-of-training summary: metrics.jsonl only
        line = None
    else:
        line = format_log_line(entry, run.total_steps) if training else format_eval_line(entry)
    run.echo(entry, line)
    completion_log = run.rollouts.completion_log
    if training and completion_log is not None and "train_runtime" not in entry:
        completion_log.write(state.global_step, run.accelerator)  # parquet, console table, tracker tables


def evaluation_parts(run: TrainingRun) -> EvaluationParts:
    """What evaluation (evaluation.evaluate) uses of the run: the eval-mode stages, through the user's overrides."""
    return EvaluationParts(
        run.config,
        run.accelerator,
        run.model,
        run.rollouts,
        prepare_inputs=lambda inputs: prepare_inputs(run, inputs),
        compute_loss=lambda batch: compute_loss(run, batch),
        log=lambda metrics: log(run, metrics),
        trainer_state=run.state,
        fire=run.fire,
        attach=lambda current: setattr(run, "evaluation_pass", current),
    )
