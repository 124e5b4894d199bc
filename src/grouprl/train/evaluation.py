"""Evaluation: sample every eval prompt, score it, report TRL's metrics with an ``eval_`` prefix.

Each eval prompt (in dataset order, once) gets ``num_generations_eval`` completions (default:
``num_generations``), sampled like training completions, in batches of
``per_device_eval_batch_size`` completions per process. They are scored by the reward functions
and their advantages computed exactly as in training; then one forward pass gives ``eval_loss``
(the policy loss at ratio 1, i.e. what a training step would minimise on these samples) and
``eval_entropy``. Nothing is trained, no checkpoint or data order changes, and GFPO does not filter.

Metric names are TRL's with a prefix: ``eval_reward``, ``eval_reward_std``,
``eval_rewards/<name>/mean|std``, ``eval_frac_reward_zero_std``, ``eval_completions/...``,
``eval_loss``, ``eval_entropy``, plus ``eval_runtime``, ``eval_samples_per_second``,
``eval_steps_per_second``. A dict of eval datasets is evaluated one by one as ``eval_<name>_*``.

Sampling runs on a forked RNG seeded with ``seed``: evaluation does not move the training RNG
(so a run with evaluation trains exactly like one without), and evaluating the same weights twice
gives the same numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import datasets
import torch
from torch.utils.data import DataLoader
from transformers.utils import logging

from grouprl.config.grpo_config import GRPOConfig, interval_due, resolve_steps
from grouprl.core.distributed import global_mean
from grouprl.core.loss_aggregations import masked_mean
from grouprl.core.losses import policy_loss
from grouprl.core.metrics import MetricWindow
from grouprl.core.stats import metrics
from grouprl.core.types import Rollout
from grouprl.data.generation_inputs import GenerationInputs
from grouprl.data.prompts import check_dataset
from grouprl.data.row_loading import sequential_loader, workers_for
from grouprl.model.policy_logprobs import policy_logprobs
from grouprl.rollout.sampler import RolloutMaker
from grouprl.train.micro_step import LossStats, Objective, objective_stats
from grouprl.train.step_reduction import Collectives, reduce_step

logger = logging.get_logger("grouprl")


def check_eval_setup(
    config: GRPOConfig, eval_dataset: Any, num_processes: int, *, prompt_required: bool = True
) -> None:
    """Check an eval setup that will be used: by the trainer when eval_strategy != "no" (before any
    model is loaded), and by every evaluate() call. As in TRL, an eval_dataset that is only stored
    is not checked at construction."""
    if config.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(
            f"GRPOConfig.eval_strategy='{getattr(config.eval_strategy, 'value', config.eval_strategy)}' needs an eval_dataset; pass one or set eval_strategy='no'."
        )
    if eval_dataset is None:
        return
    named = eval_dataset if isinstance(eval_dataset, dict) else {"": eval_dataset}
    for name, dataset in named.items():
        check_dataset(dataset, f"eval_dataset[{name!r}]" if name else "eval_dataset", prompt_required=prompt_required)
    size = config.num_generations_eval or config.num_generations
    if size < 1:
        raise ValueError(f"GRPOConfig.num_generations_eval={config.num_generations_eval} must be >= 1.")
    batch = config.per_device_eval_batch_size * num_processes
    if batch % size != 0:
        fits = [b for b in range(1, 4 * size + 1) if (b * num_processes) % size == 0][:4]
        raise ValueError(
            f"The eval batch (per_device_eval_batch_size={config.per_device_eval_batch_size} x {num_processes} processes = {batch} "
            f"completions) must be divisible by num_generations_eval={size} (default: num_generations), so each prompt's "
            f"completions are scored together. Use per_device_eval_batch_size in {fits} or change num_generations_eval."
        )


def should_evaluate(config: GRPOConfig, step: int, total_steps: int, steps_per_epoch: Optional[int]) -> bool:
    """Scheduled evaluation at this optimizer step (eval_delay counts steps, or epochs with eval_strategy='epoch')."""
    every = resolve_steps(config.eval_steps if config.eval_steps is not None else config.logging_steps, total_steps)
    delayed = (
        step < config.eval_delay
        if config.eval_strategy == "steps"
        else bool(steps_per_epoch) and step / steps_per_epoch < config.eval_delay
    )
    return interval_due(config.eval_strategy, step, every, steps_per_epoch) and not delayed


@dataclass(frozen=True)
class EvaluationParts:
    """What an evaluation uses of the run (built by the loop's TrainingRun.evaluation_parts)."""

    config: GRPOConfig
    accelerator: Any
    model: torch.nn.Module  # the prepared policy
    rollouts: RolloutMaker  # the training sampler: its parts are shared, its counters are not
    hooks: Any  # the GRPOTrainer: _prepare_inputs, compute_loss and log are TRL override points
    trainer_state: Any  # transformers.TrainerState
    fire: Callable[..., Any]  # a TrainerCallback event
    attach: Callable[[Optional["EvaluationPass"]], None]  # makes the pass visible to the eval-mode override points


def evaluate(parts: EvaluationParts, eval_dataset: Any, metric_key_prefix: str = "eval") -> dict[str, float]:
    """Evaluate on a Dataset (or a dict name -> Dataset); log the metrics and return them."""
    if eval_dataset is None:
        raise ValueError("evaluate() needs an eval_dataset: pass it to GRPOTrainer(eval_dataset=...) or to evaluate().")
    check_eval_setup(
        parts.config,
        eval_dataset,
        parts.accelerator.num_processes,
        prompt_required=parts.rollouts.settings.default_prompt is None,
    )
    if isinstance(eval_dataset, dict):
        metrics: dict[str, float] = {}
        for name, dataset in eval_dataset.items():
            metrics.update(evaluate(parts, dataset, f"{metric_key_prefix}_{name}"))
        return metrics
    started = time.time()
    was_training = parts.model.training
    parts.model.eval()  # as in TRL, the trainer's override points see model.training False during evaluation and its log
    try:
        window, batches, completions = _sample_and_score(parts, eval_dataset)
        runtime = time.time() - started
        summary = {k: v for k, v in window.summary().items() if k != "num_tokens"}
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in summary.items()}
        metrics.update(
            {
                f"{metric_key_prefix}_runtime": runtime,
                f"{metric_key_prefix}_samples_per_second": completions / max(runtime, 1e-9),
                f"{metric_key_prefix}_steps_per_second": batches / max(runtime, 1e-9),
            }
        )
        parts.hooks.log(metrics)  # log_history, trackers, on_log, metrics.jsonl and an "eval at step" line
    finally:
        parts.model.train(was_training)
    parts.fire("on_evaluate", metrics=metrics)
    return metrics


@dataclass
class EvaluationPass:
    """What the trainer's eval-mode defaults use while an evaluation runs (the run's evaluation_pass)."""

    rollouts: RolloutMaker  # G_eval completions per prompt, its own counters
    window: MetricWindow  # the eval metrics


def eval_batch(
    evaluation_pass: Optional["EvaluationPass"], inputs: GenerationInputs, *, accelerator: Any, trainer_state: Any
) -> Any:
    """One eval batch sampled and scored (GRPOTrainer._generate_and_score_completions in eval mode): no old or
    reference logprobs, nothing buffered."""
    current = current_pass(evaluation_pass)
    prompts = inputs.prompt_batch
    with accelerator.autocast():
        rollout = Rollout(prompts, current.rollouts.generate(prompts))
    rollout, _, advantages = current.rollouts.score(rollout, trainer_state, current.window)
    return current.rollouts.make_train_batch(rollout, advantages)


def current_pass(evaluation_pass: Optional[EvaluationPass]) -> EvaluationPass:
    if evaluation_pass is None:
        raise RuntimeError(
            "The trainer's model is in eval mode outside of evaluate(): its eval-mode steps (_generate_and_score_completions, "
            "_compute_loss) run inside trainer.evaluate(); call model.train() before training steps."
        )
    return evaluation_pass


def format_eval_line(entry: dict[str, Any]) -> str:
    shown = [
        f"{k} {v:.4g}"
        for k, v in entry.items()
        if k.endswith(("_reward", "_loss", "_reward_std")) and isinstance(v, float)
    ]
    return f"eval at step {entry.get('step')} | " + " | ".join(shown)


def _eval_rollouts(training: RolloutMaker, num_generations: int) -> RolloutMaker:
    """The eval sampler: the training one's backend, prompts, rewards, agent and override hooks, with G_eval, fresh
    counters, no completion log and no row filter (GFPO does not filter in evaluation)."""
    return RolloutMaker(
        accelerator=training.accelerator,
        backend=training.backend,
        sampler=training.sampler,
        tokenize=training.tokenize,
        reward_functions=training.reward_functions,
        reward_weights=training.reward_weights,
        sampling=training.sampling,
        settings=replace(training.settings, num_generations=num_generations),
        synced_step=training.synced_step,
        agent=training.agent,
        recent=training.recent,
        generate_hook=training.generate_hook,
        reward_hook=training.reward_hook,
    )


def pick_eval_dataset(default: Any, chosen: Any) -> Any:
    """The eval dataset meant: `chosen` (a dataset, or a key of a dict default), else the trainer's own."""
    if isinstance(chosen, str):
        if not isinstance(default, dict) or chosen not in default:
            raise ValueError(
                f"eval_dataset={chosen!r} names no eval dataset; the trainer's are "
                f"{sorted(default) if isinstance(default, dict) else 'not a dict'}."
            )
        return default[chosen]
    dataset = default if chosen is None else chosen
    if dataset is None:
        raise ValueError("No eval_dataset: pass one to GRPOTrainer(eval_dataset=...) or to this call.")
    if isinstance(dataset, dict):
        raise ValueError(
            f"eval_dataset is a dict ({sorted(dataset)}); name the one meant, e.g. get_eval_dataloader({next(iter(dataset))!r})."
        )
    return dataset


def eval_loader(dataset: Any, config: GRPOConfig, num_processes: int) -> DataLoader:
    """The eval prompts' rows in dataset order, one eval batch of prompts at a time, as lists of (index, row).

    Map-style data is read by dataloader_num_workers worker processes; a stream in this process (row_loading.py).
    """
    prompts_per_batch = (
        config.per_device_eval_batch_size * num_processes // (config.num_generations_eval or config.num_generations)
    )
    return sequential_loader(
        dataset, prompts_per_batch, num_workers=workers_for(dataset, config.dataloader_num_workers)
    )


def _sample_and_score(parts: EvaluationParts, dataset: Any) -> tuple[MetricWindow, int, int]:
    config, accelerator, hooks = parts.config, parts.accelerator, parts.hooks
    size = config.num_generations_eval or config.num_generations
    parts.rollouts.sync_weights(
        accelerator.unwrap_model(parts.model), parts.trainer_state.global_step
    )  # a server samples the current weights
    rollouts = _eval_rollouts(parts.rollouts, size)
    window, batches, completions = MetricWindow(), 0, 0
    parts.attach(EvaluationPass(rollouts, window))
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(config.seed)
            for number, pairs in enumerate(eval_loader(dataset, config, accelerator.num_processes)):
                indices, rows = [index for index, _ in pairs], [row for _, row in pairs]
                if (len(rows) * size) % accelerator.num_processes:
                    logger.warning(
                        "evaluation: the last %d prompts cannot be split evenly over %d processes and are skipped.",
                        len(rows),
                        accelerator.num_processes,
                    )
                    break
                inputs = rollouts.prompt_inputs(indices, rows, number)
                batch = hooks._prepare_inputs(inputs)  # eval mode: _generate_and_score_completions(inputs), as TRL
                with torch.no_grad():
                    loss = hooks.compute_loss(parts.model, batch)
                window.add("loss", global_mean(accelerator, float(loss)))
                batches += 1
                completions += len(rows) * size
    finally:
        parts.attach(None)
    if isinstance(dataset, datasets.Dataset) and batches == 0:
        raise ValueError("evaluation: the eval dataset produced no complete batch.")
    return window, batches, completions


def eval_loss(
    model: torch.nn.Module,
    batch: Any,
    objective: Objective,
    *,
    evaluation_pass: Optional[EvaluationPass],
    hooks: Any,
    accelerator: Any,
    rows_per_chunk: int,
) -> torch.Tensor:
    """The policy loss at ratio 1 on eval samples (GRPOTrainer._compute_loss in eval mode); eval_entropy and the loss's
    statistics, reduced over the processes in one reduction, go to the eval window."""
    window = current_pass(evaluation_pass).window
    b = batch.to(accelerator.device)
    with torch.no_grad(), accelerator.autocast():
        out = policy_logprobs(
            hooks,
            model,
            b,
            temperature=objective.temperature,
            rows_per_chunk=rows_per_chunk,
            pack_prompts=objective.pack_shared_prompts,
        )
        settings = {**objective.loss_kwargs, "beta": 0.0}  # no reference pass in evaluation: the KL term is left out
        loss, values = policy_loss(
            objective.loss_type,
            out.logprobs,
            None,
            b.advantages,
            b.loss_mask,
            **settings,
            grad_accum_steps=1,
            token_denominator=max(batch.num_loss_tokens, 1.0) / accelerator.num_processes,
        )
    tokens = b.loss_mask.sum()
    stats = LossStats(
        tokens=tokens,
        rows=float(len(b)),
        entropy=masked_mean(out.entropy, b.loss_mask),  # model tokens only
        objective=objective_stats(values, tokens, float(len(b)), objective.sequence_level),
    )
    (reduced,), _ = reduce_step([stats], Collectives.of(accelerator))
    window.add_all(metrics(reduced))
    return loss
