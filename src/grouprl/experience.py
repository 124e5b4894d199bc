"""One generation batch, made ready to train on (score_generation: GRPOTrainer._generate_and_score_completions),
then cut into micro-batches (split_generation, called by GRPOTrainer._prepare_inputs).

    draw completions -> rewards -> advantages -> TrainBatch
        (dynamic sampling: drop groups whose rewards tie, draw further generations to refill)
    -> old logprobs         if the samples are reused after an update (TRL §2.6) or the sampler's
                            logprobs are to be corrected
    -> sampler IS weights   if the backend returned sampler logprobs (any backend, not only vLLM)
    -> reference logprobs   if beta != 0
    -> shuffle the rows, cut them into steps_per_generation micro-batches (rows of similar length
       together within each optimizer step, batching.py), queued num_iterations times
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.utils import logging

from .algorithms.masks import tied_groups
from .distributed import layout_of, whole_groups
from .group_layout import own_rollout
from .algorithms.importance import sampler_importance_weights
from .algorithms.losses import LOSSES
from .batching import length_grouped, regrouping_is_exact, row_order_key
from .generation_inputs import GenerationInputs
from .health import guard_advantages
from .objective import policy_logprobs
from .types import Rewards, Rollout, TrainBatch

if TYPE_CHECKING:
    from .loop import TrainingRun

logger = logging.get_logger("grouprl")


def score_generation(run: "TrainingRun", inputs: GenerationInputs) -> TrainBatch:
    """One generation batch made ready to train on (GRPOTrainer._generate_and_score_completions): completions, rewards,
    advantages, and the old / reference logprobs and sampler weights it needs."""
    config, plan = run.config, run.plan
    with run.timer.phase("sync_weights"):
        run.rollouts.sync_weights(run.accelerator.unwrap_model(run.model), run.state.global_step)
    batch = draw_batch(run, inputs)
    # An in-process sampler draws from the very weights being trained: nothing to correct, and the
    # extra forward pass for pi_old would be pure cost. Separate engines (server, vLLM) say they need it.
    separate_sampler = getattr(run.rollouts.backend, "needs_importance_correction", True)
    correct_sampler = batch.sampler_logprobs is not None and config.vllm_importance_sampling_correction and separate_sampler
    if plan.old_logprobs_needed or correct_sampler:  # remember pi_old (the trainer's view of the sampling policy)
        with run.timer.phase("old_logprobs"):
            batch.old_logprobs = batch_logprobs(run, run.model, batch)
    if correct_sampler:
        if not LOSSES[config.loss_type].sampler_weights_in_loss and config.vllm_importance_sampling_mode.startswith("sequence"):
            raise ValueError(
                f"loss_type={config.loss_type!r} folds the sampler-mismatch correction into its token-level weights, so it needs "
                f"vllm_importance_sampling_mode='token_truncate' or 'token_mask', not {config.vllm_importance_sampling_mode!r}."
            )
        rho, stats = sampler_importance_weights(
            batch.old_logprobs, batch.sampler_logprobs, batch.loss_mask, mode=config.vllm_importance_sampling_mode,
            clip_min=config.vllm_importance_sampling_clip_min, clip_max=config.vllm_importance_sampling_clip_max,
        )
        batch.is_weights = rho.expand_as(batch.old_logprobs).contiguous()  # (n, T)
        run.window.add_all(stats)
    if config.beta != 0.0:
        with run.timer.phase("ref_logprobs"):
            with run.reference.scoring(run.model, run.accelerator.unwrap_model(run.model)) as reference:
                batch.ref_logprobs = batch_logprobs(run, reference, batch)
    return batch


def split_generation(run: "TrainingRun", batch: TrainBatch) -> list[TrainBatch]:
    """Shuffle a generation batch's rows and cut them into its micro-batches, queued num_iterations times."""
    config, plan = run.config, run.plan
    order = torch.randperm(len(batch))  # global RNG, seeded: reproducible and restored on resume
    parts = list(torch.tensor_split(order, plan.steps_per_generation))
    if regrouping_is_exact(config.loss_type, config.top_entropy_quantile, [len(p) for p in parts]):
        parts = length_grouped(parts, row_order_key(batch), grad_accum_steps=plan.gradient_accumulation_steps)
    micro = [batch.select(rows) for rows in parts]
    return micro * plan.num_iterations


@torch.no_grad()
def batch_logprobs(run: "TrainingRun", model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """(n, T) logprobs of the batch's completions under `model`, in chunks of one micro-batch."""
    with run.accelerator.autocast():
        b = batch.to(run.accelerator.device)
        out = policy_logprobs(run, model, b, rows_per_chunk=run.plan.per_device_batch_size, with_entropy=False)
    return out.logprobs.float().cpu()


def draw_batch(run: "TrainingRun", inputs: GenerationInputs) -> TrainBatch:
    if run.config.dynamic_sampling:
        rollout, advantages = dynamic_sample(run, inputs)
    else:
        with run.timer.phase("generate"), run.accelerator.autocast():
            rollout = run.rollouts.sample(inputs)
        with run.timer.phase("reward"):
            rollout, _, advantages = run.rollouts.score(rollout, run.state, run.window)
    guard_advantages(run, advantages)
    return run.rollouts.make_train_batch(rollout, advantages)


def dynamic_sample(run: "TrainingRun", inputs: GenerationInputs) -> tuple[Rollout, torch.Tensor]:
    """DAPO dynamic sampling: keep only groups whose rewards differ.

    Draws generations until the kept groups fill one generation batch, or
    `max_dynamic_sampling_rounds` extra generations were drawn; then trains on the groups found
    (a smaller batch), or, if none carried any signal, on the last generation as it is. Advantages
    are computed over the kept groups. Reward and length metrics cover every generation drawn.
    With several processes every process gathers each generation whole, so groups are kept or
    dropped whole, and the kept rows are then dealt out evenly again (a process's share may cut a
    group); if fewer rows were kept than processes x steps_per_generation, the last generation is
    trained as it is, so that no process runs a micro-step without rows.
    """
    config = run.config
    group_size, needed = config.num_generations, run.plan.prompts_per_generation
    kept_rollouts: list[Rollout] = []
    kept_rewards: list[Rewards] = []
    drawn = rounds = 0
    for attempt in range(1 + config.max_dynamic_sampling_rounds):
        with run.timer.phase("generate"), run.accelerator.autocast():
            rollout = run.rollouts.sample(inputs if attempt == 0 else None)  # further rounds draw further prompts
        with run.timer.phase("reward"):
            rollout, rewards, _ = run.rollouts.score(rollout, run.state, run.window)
        layout = layout_of(rollout.prompts)
        rollout = whole_groups(rollout, layout)  # every process sees the whole batch, so groups are kept or dropped whole
        drawn, rounds = drawn + len(rollout.completions), rounds + 1
        tied = tied_groups(rewards.total, group_size)  # (prompts,)
        keep = [b for b in range(len(rollout.prompts)) if not tied[b]]
        if keep:
            kept_rollouts.append(rollout.select_prompts(keep))
            kept_rewards.append(rewards.select(rollout.prompt_rows(keep)))
        if sum(len(r.prompts) for r in kept_rollouts) >= needed:
            break
    kept_rows, processes, micro_steps = sum(len(r.completions) for r in kept_rollouts), run.plan.num_processes, run.plan.steps_per_generation
    if processes > 1 and 0 < kept_rows < processes * micro_steps:  # each process needs a row in every micro-step (DDP)
        logger.warning("dynamic_sampling: %d kept completions cannot feed %d processes x %d micro-steps; training on the last "
                       "generation as it is.", kept_rows, processes, micro_steps)
        kept_rollouts = []
    if kept_rollouts:
        rollout = Rollout.concat(kept_rollouts)
        rewards = Rewards.concat(kept_rewards)
        if len(rollout.prompts) > needed:  # the last generation overfilled the batch: drop the surplus groups
            first = list(range(needed))
            rollout, rewards = rollout.select_prompts(first), rewards.select(rollout.prompt_rows(first))
    elif kept_rows == 0:
        logger.warning(
            "dynamic_sampling: every group of %d generation(s) had tied rewards; training on the last one "
            "(all advantages are 0).", rounds,
        )
    advantages, _ = run.rollouts.global_advantages(rewards)
    run.window.add_all({
        "dynamic_sampling/completions_drawn": drawn,
        "dynamic_sampling/generation_rounds": rounds,
        "dynamic_sampling/kept_groups": len(rollout.prompts) if kept_rollouts else 0,
    })
    dealt = layout.redealt(rollout.prompts.group_ids, rollout.prompts.num_samples)  # the kept groups over the processes
    return own_rollout(dealt, rollout), advantages[dealt.local_rows]
