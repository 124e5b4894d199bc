"""One generation batch, made ready to train on (score_generation: GRPOTrainer._generate_and_score_completions),
then cut into micro-batches (split_generation, called by GRPOTrainer._prepare_inputs).

    score_generation(sampling, model, inputs) -> (TrainBatch, ExperienceStats)
    draw completions -> rewards -> advantages
        (dynamic sampling: drop groups whose rewards tie, draw further generations to refill)
    -> old logprobs         if the samples are reused after an update (TRL §2.6) or the sampler's
                            logprobs are to be corrected
    -> sampler IS weights   if the backend returned sampler logprobs (any backend, not only vLLM)
    -> reference logprobs   if beta != 0
    -> one complete TrainBatch (nothing is filled in afterwards), and its statistics (the advantages,
       which must be finite, and the sampler IS statistics, reduced over every process by the loop)
    -> shuffle the rows, cut them into steps_per_generation micro-batches (rows of similar length
       together within each optimizer step, train_batch.py), queued num_iterations times
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from transformers.utils import logging

from grouprl.config.grpo_config import BatchPlan, GRPOConfig
from grouprl.core.distributed import layout_of, own_rollout, whole_groups
from grouprl.core.losses import LOSSES, sampler_importance_weights
from grouprl.core.masks import tied_groups
from grouprl.core.overrides import NO_OVERRIDES, Overrides
from grouprl.core.stats import finite, largest, mean, smallest
from grouprl.core.types import Rewards, Rollout, TrainBatch
from grouprl.data.prompt_sampler import GenerationInputs
from grouprl.model.logprobs import policy_logprobs
from grouprl.rollout.train_batch import length_grouped, regrouping_is_exact, row_order_key

logger = logging.get_logger("grouprl")


@dataclass(frozen=True)
class ExperienceStats:
    """One generation batch's statistics (TRL's names); the loop reduces them over every process."""

    advantages: Optional[torch.Tensor] = finite(
        "advantages"
    )  # this process's (n,) advantages: NaN / inf stops every process
    logp_gap_mean: Optional[float] = mean(
        "sampling/sampling_logp_difference/mean"
    )  # means of per-process values, as TRL
    logp_gap_max: Optional[float] = largest("sampling/sampling_logp_difference/max")
    ratio_min: Optional[float] = smallest("sampling/importance_sampling_ratio/min")
    ratio_mean: Optional[float] = mean("sampling/importance_sampling_ratio/mean")
    ratio_max: Optional[float] = largest("sampling/importance_sampling_ratio/max")
    masked_fraction: Optional[float] = mean("sampling/importance_sampling_masked_fraction")
    # dynamic sampling: counted over the whole batch, the same on every process
    completions_drawn: Optional[float] = mean("dynamic_sampling/completions_drawn")
    generation_rounds: Optional[float] = mean("dynamic_sampling/generation_rounds")
    kept_groups: Optional[float] = mean("dynamic_sampling/kept_groups")
    # asynchronous generation (async_rollouts.py): the same on every process (the main process's producer says)
    staleness_mean: Optional[float] = mean("async/staleness_mean")  # optimizer steps the sampling weights lag
    staleness_max: Optional[float] = largest("async/staleness_max")
    dropped_groups: Optional[float] = mean("async/dropped_groups")  # dropped as too stale (and regenerated)
    queue_size: Optional[float] = mean("async/queue_size")  # finished completions left waiting after the take
    trainer_wait_s: Optional[float] = mean("async/trainer_wait_s")  # the trainer waited for the generation
    generator_wait_s: Optional[float] = mean("async/generator_wait_s")  # the worker had nothing it could sample
    # the captured loop's compiles (static_decode.CapturedGenerator.report): seconds this batch's generations spent
    # compiling new shapes of the step (apart from its steps' time), and the compiled shapes held
    compile_s: Optional[float] = largest("generation/compile_s")
    compiled_graphs: Optional[float] = largest("generation/compiled_graphs")


_SAMPLER_STATS = {  # sampler_importance_weights' names -> ExperienceStats fields
    "sampling/sampling_logp_difference/mean": "logp_gap_mean",
    "sampling/sampling_logp_difference/max": "logp_gap_max",
    "sampling/importance_sampling_ratio/min": "ratio_min",
    "sampling/importance_sampling_ratio/mean": "ratio_mean",
    "sampling/importance_sampling_ratio/max": "ratio_max",
    "sampling/importance_sampling_masked_fraction": "masked_fraction",
}


@dataclass(frozen=True)
class Sampling:
    """What making a generation batch uses besides the model: the sampler, settings and the run's counters."""

    rollouts: Any  # rollout.RolloutMaker
    config: GRPOConfig
    plan: BatchPlan
    accelerator: Any  # autocast, device, unwrap_model
    trainer_state: Any  # transformers.TrainerState (reward functions may read it)
    window: Any  # the metric window the sampler's reward / length statistics go to (already global)
    timer: Any  # metrics.PhaseTimer


def score_generation(
    sampling: Sampling,
    model: torch.nn.Module,
    inputs: GenerationInputs,
    *,
    overrides: Overrides = NO_OVERRIDES,
    reference: Any = None,
) -> tuple[TrainBatch, ExperienceStats]:
    """One generation batch made ready to train on (GRPOTrainer._generate_and_score_completions): completions, rewards,
    advantages, and the old / reference logprobs and sampler weights it needs, built once; with its statistics."""
    config, plan, accelerator, timer = sampling.config, sampling.plan, sampling.accelerator, sampling.timer
    with timer.phase("sync_weights"):
        sampling.rollouts.sync_weights(accelerator.unwrap_model(model), sampling.trainer_state.global_step)
    batch, counts = draw_batch(sampling, inputs)
    sampling.rollouts.release_sampler()
    counts = {**counts, **sampling.rollouts.sampler_report()}
    # The gap between the sampler's logprobs and the trainer's is measured for every sampler that returns them. A
    # separate engine (server, vLLM, an asynchronous worker) samples from another copy of the weights; an in-process
    # one from the trained weights themselves, but wherever either computes below fp32 (bf16 autocast or weights) by
    # other kernels and shapes than the training forward's, so its logprobs differ by rounding (0.03 nats a token
    # measured on SmolLM2-135M): both are corrected by vllm_importance_sampling_correction (docs/generation.md).
    separate_sampler = sampling.rollouts.sampler_is_separate
    measured = batch.sampler_logprobs is not None
    correct_sampler = (
        measured
        and config.vllm_importance_sampling_correction
        and (separate_sampler or computes_below_fp32(model, accelerator))
    )
    if config.vllm_importance_sampling_correction and separate_sampler and not measured:
        logger.warning_once(
            "vllm_importance_sampling_correction: the sampler is a separate copy of the weights, but some completions "
            "came without the sampled tokens' logprobs (a rollout_func returning logprobs=None, or a generation "
            "backend that returns none), so such batches train without the correction. Return the logprobs, set "
            "needs_importance_correction = False on a backend that samples from the training weights, or set "
            "vllm_importance_sampling_correction=False."
        )
    # Trained once with the weights it is sampled or taken at, pi_old is what the training forward computes anyway,
    # so the gap is measured (and corrected) there (micro_step.py), not in a forward pass of its own; a synchronous
    # separate engine keeps TRL's pass.
    in_forward = measured and not plan.old_logprobs_needed and (config.async_generation or not separate_sampler)
    old_logprobs = is_weights = ref_logprobs = None
    sampler_stats: dict[str, Any] = {}
    if plan.old_logprobs_needed or (correct_sampler and not in_forward):  # pi_old: the trainer's view of the sampler
        with timer.phase("old_logprobs"):
            old_logprobs = batch_logprobs(
                model,
                batch,
                accelerator,
                plan.per_device_batch_size,
                config.temperature,
                config.pack_shared_prompts,
                overrides,
            )
    if correct_sampler:
        if not LOSSES[config.loss_type].sampler_weights_in_loss and config.vllm_importance_sampling_mode.startswith(
            "sequence"
        ):
            raise ValueError(
                f"loss_type={config.loss_type!r} folds the sampler-mismatch correction into its token-level weights, "
                "so it needs vllm_importance_sampling_mode='token_truncate' or 'token_mask', not "
                f"{config.vllm_importance_sampling_mode!r}."
            )
    if measured and old_logprobs is not None:
        rho, values = sampler_importance_weights(
            old_logprobs,
            batch.sampler_logprobs,
            batch.loss_mask,
            mode=config.vllm_importance_sampling_mode,
            clip_min=config.vllm_importance_sampling_clip_min,
            clip_max=config.vllm_importance_sampling_clip_max,
        )
        is_weights = rho.expand_as(old_logprobs).contiguous() if correct_sampler else None  # (n, T)
        sampler_stats = {_SAMPLER_STATS[name]: value for name, value in values.items()}
    in_forward_use = None if not in_forward else "correct" if correct_sampler else "measure"
    if config.beta != 0.0:
        with timer.phase("ref_logprobs"):
            with reference.scoring(model, accelerator.unwrap_model(model)) as ref_model:
                ref_logprobs = batch_logprobs(
                    ref_model,
                    batch,
                    accelerator,
                    plan.per_device_batch_size,
                    config.temperature,
                    config.pack_shared_prompts,
                    overrides,
                )
    batch = replace(
        batch,
        old_logprobs=old_logprobs,
        is_weights=is_weights,
        ref_logprobs=ref_logprobs,
        sampler_in_forward=in_forward_use,
    )
    return batch, ExperienceStats(advantages=batch.advantages, **sampler_stats, **counts)


def computes_below_fp32(model: torch.nn.Module, accelerator: Any) -> bool:
    """Whether sampling and training compute in a precision below fp32: bf16 / fp16 autocast, or such weights."""
    if getattr(accelerator, "mixed_precision", "no") not in (None, "no"):
        return True
    weight = next(model.parameters(), None)
    return weight is not None and weight.dtype in (torch.bfloat16, torch.float16)


def split_generation(
    batch: TrainBatch, plan: BatchPlan, *, loss_type: str, top_entropy_quantile: float
) -> list[TrainBatch]:
    """Shuffle a generation batch's rows and cut them into its micro-batches, queued num_iterations times."""
    order = torch.randperm(len(batch))  # global RNG, seeded: reproducible and restored on resume
    parts = list(torch.tensor_split(order, plan.steps_per_generation))
    if regrouping_is_exact(loss_type, top_entropy_quantile, [len(p) for p in parts]):
        parts = length_grouped(parts, row_order_key(batch), grad_accum_steps=plan.gradient_accumulation_steps)
    micro = [batch.select(rows) for rows in parts]
    return micro * plan.num_iterations


@torch.no_grad()
def batch_logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    accelerator: Any,
    rows_per_chunk: int,
    temperature: float,
    pack_prompts: bool = True,
    overrides: Overrides = NO_OVERRIDES,
) -> torch.Tensor:
    """(n, T) logprobs of the batch's completions under `model`, in chunks of one micro-batch."""
    with accelerator.autocast():
        b = batch.to(accelerator.device)
        out = policy_logprobs(
            model,
            b,
            temperature=temperature,
            rows_per_chunk=rows_per_chunk,
            with_entropy=False,
            pack_prompts=pack_prompts,
            overrides=overrides,
        )
    return out.logprobs.float().cpu()


def draw_batch(sampling: Sampling, inputs: GenerationInputs) -> tuple[TrainBatch, dict[str, float]]:
    """Completions, rewards and advantages as a TrainBatch (no logprobs yet), and the dynamic-sampling counts."""
    counts: dict[str, float] = {}
    if sampling.config.dynamic_sampling:
        rollout, advantages, counts = dynamic_sample(sampling, inputs)
    else:
        rollout = _sample(sampling, inputs)
        with sampling.timer.phase("reward"):
            rollout, _, advantages = sampling.rollouts.score(rollout, sampling.trainer_state, sampling.window)
    return sampling.rollouts.make_train_batch(rollout, advantages), counts


def _sample(sampling: Sampling, inputs: Optional[GenerationInputs]) -> Rollout:
    with sampling.timer.phase("generate"), sampling.accelerator.autocast():
        return sampling.rollouts.sample(inputs)


def dynamic_sample(sampling: Sampling, inputs: GenerationInputs) -> tuple[Rollout, torch.Tensor, dict[str, float]]:
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
    config, plan = sampling.config, sampling.plan
    group_size, needed = config.num_generations, plan.prompts_per_generation
    kept_rollouts: list[Rollout] = []
    kept_rewards: list[Rewards] = []
    drawn = rounds = 0
    for attempt in range(1 + config.max_dynamic_sampling_rounds):
        rollout = _sample(sampling, inputs if attempt == 0 else None)  # further rounds draw further prompts
        with sampling.timer.phase("reward"):
            rollout, rewards, _ = sampling.rollouts.score(rollout, sampling.trainer_state, sampling.window)
        layout = layout_of(rollout.prompts)
        rollout = whole_groups(
            rollout, layout
        )  # every process sees the whole batch, so groups are kept or dropped whole
        drawn, rounds = drawn + len(rollout.completions), rounds + 1
        tied = tied_groups(rewards.total, group_size)  # (prompts,)
        keep = [b for b in range(len(rollout.prompts)) if not tied[b]]
        if keep:
            kept_rollouts.append(rollout.select_prompts(keep))
            kept_rewards.append(rewards.select(rollout.prompt_rows(keep)))
        if sum(len(r.prompts) for r in kept_rollouts) >= needed:
            break
    kept_rows, processes, micro_steps = (
        sum(len(r.completions) for r in kept_rollouts),
        plan.num_processes,
        plan.steps_per_generation,
    )
    if processes > 1 and 0 < kept_rows < processes * micro_steps:  # each process needs a row in every micro-step (DDP)
        logger.warning(
            "dynamic_sampling: %d kept completions cannot feed %d processes x %d micro-steps; training on the last "
            "generation as it is.",
            kept_rows,
            processes,
            micro_steps,
        )
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
            "(all advantages are 0).",
            rounds,
        )
    advantages, _ = sampling.rollouts.global_advantages(rewards)
    counts = {
        "completions_drawn": float(drawn),
        "generation_rounds": float(rounds),
        "kept_groups": float(len(rollout.prompts) if kept_rollouts else 0),
    }
    dealt = layout.redealt(rollout.prompts.group_ids, rollout.prompts.num_samples)  # the kept groups over the processes
    return own_rollout(dealt, rollout), advantages[dealt.local_rows], counts
