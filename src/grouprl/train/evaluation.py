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

This module runs an evaluation (`evaluate`) and schedules it (`should_evaluate`); the eval datasets are
checked, picked and read in eval_data.py, and the trainer's eval-mode override points (one eval batch,
its loss) are in eval_mode.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import datasets
import torch
from transformers.utils import logging

from grouprl.config.grpo_config import GRPOConfig
from grouprl.core.distributed import global_mean
from grouprl.core.metrics import MetricWindow
from grouprl.rollout.sampler import RolloutMaker
from grouprl.train.eval_data import check_eval_setup, eval_loader
from grouprl.train.eval_mode import EvaluationPass

logger = logging.get_logger("grouprl")


@dataclass(frozen=True)
class EvaluationParts:
    """What an evaluation uses of the run (built by stages.evaluation_parts)."""

    config: GRPOConfig
    accelerator: Any
    model: torch.nn.Module  # the prepared policy
    rollouts: RolloutMaker  # the training sampler: its parts are shared, its counters are not
    # the eval-mode stages, each a user's TRL override where there is one (stages.py)
    prepare_inputs: Callable[[Any], Any]  # _prepare_inputs: a generation batch sampled and scored
    compute_loss: Callable[[Any], Any]  # compute_loss of that batch
    log: Callable[[dict[str, float]], None]  # log
    trainer_state: Any  # transformers.TrainerState
    fire: Callable[..., Any]  # a TrainerCallback event
    attach: Callable[[Optional[EvaluationPass]], None]  # makes the pass visible to the eval-mode override points


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
    # as in TRL, the trainer's override points see model.training False during evaluation and its log
    parts.model.eval()
    try:
        window, batches, completions = _sample_and_score(parts, eval_dataset)
        runtime = time.time() - started
        # num_tokens is the run's count so far, as TRL logs it in evaluation too: evaluation does not add to it
        summary = {**window.summary(), "num_tokens": float(parts.trainer_state.num_input_tokens_seen)}
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in summary.items()}
        metrics.update(
            {
                f"{metric_key_prefix}_runtime": runtime,
                f"{metric_key_prefix}_samples_per_second": completions / max(runtime, 1e-9),
                f"{metric_key_prefix}_steps_per_second": batches / max(runtime, 1e-9),
            }
        )
        parts.log(metrics)  # log_history, trackers, on_log, metrics.jsonl and an "eval at step" line
    finally:
        parts.model.train(was_training)
    parts.fire("on_evaluate", metrics=metrics)
    return metrics


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


def _sample_and_score(parts: EvaluationParts, dataset: Any) -> tuple[MetricWindow, int, int]:
    config, accelerator = parts.config, parts.accelerator
    size = config.num_generations_eval or config.num_generations
    # a server samples the current weights
    parts.rollouts.sync_weights(accelerator.unwrap_model(parts.model), parts.trainer_state.global_step)
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
                batch = parts.prepare_inputs(inputs)  # eval mode: _generate_and_score_completions(inputs), as TRL
                with torch.no_grad():
                    loss = parts.compute_loss(batch)
                window.add("loss", global_mean(accelerator, float(loss)))
                batches += 1
                completions += len(rows) * size
    finally:
        parts.attach(None)
    if isinstance(dataset, datasets.Dataset) and batches == 0:
        raise ValueError("evaluation: the eval dataset produced no complete batch.")
    return window, batches, completions
