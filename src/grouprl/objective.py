"""One micro-step: forward the policy on a micro-batch, build the GRPO objective, backward.

    train_micro_batch: trainer.compute_loss(model, micro) -> backward
    micro_batch_loss (GRPOTrainer._compute_loss):
        forward (logprobs, entropy, MoE aux loss)            trainer._get_per_token_logps_and_entropies if overridden
        -> high-entropy token mask                             trainer.get_high_entropy_mask (threshold over every process's loss tokens)
        -> off-policy sequence mask                            trainer.get_off_policy_mask (behaviour = sampler logprobs if any, else pi_old)
        -> losses.policy_loss (objective, masks, sampler weights, KL, aggregation, entropy bonus)
        -> + router_aux_loss_coef * aux / GA, metrics

The named trainer methods are TRL's override points: a subclass's version is what runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from .algorithms.logprobs import TokenLogprobs, completion_logprobs
from .algorithms.losses import dapo_denominator, masked_mean, policy_loss
from .config import GRPOConfig
from .distributed import global_mean
from .health import guard_loss

if TYPE_CHECKING:
    from .loop import TrainingRun


def loss_settings(config: GRPOConfig) -> dict[str, Any]:
    """The scalar keyword arguments of `policy_loss` that come straight from the config."""
    return dict(
        epsilon_low=config.epsilon,
        epsilon_high=config.effective_epsilon_high,
        delta=config.delta,
        importance_sampling_level=config.importance_sampling_level,
        max_completion_length=config.max_completion_length,
        sapo_temperature_pos=config.sapo_temperature_pos,
        sapo_temperature_neg=config.sapo_temperature_neg,
        vespo_k_pos=config.vespo_k_pos,
        vespo_lambda_pos=config.vespo_lambda_pos,
        vespo_k_neg=config.vespo_k_neg,
        vespo_lambda_neg=config.vespo_lambda_neg,
        beta=config.beta,
        use_bias_correction_kl=config.use_bias_correction_kl,
        loss_params=config.loss_kwargs or {},
    )


def train_micro_batch(run: "TrainingRun", micro: Any) -> float:
    """Loss (trainer.compute_loss) and backward of one micro-batch; returns the (already GA-scaled) loss."""
    if len(micro) == 0:  # dynamic sampling kept fewer rows than micro-steps
        return 0.0
    loss = run.trainer.compute_loss(run.model, micro)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"{type(run.trainer).__name__}.compute_loss must return the loss as a one-element tensor, got "
                        f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}.")
    with run.timer.phase("backward"):
        run.accelerator.backward(loss)
    run.count_flos(micro)
    return loss.item()


def micro_batch_loss(run: "TrainingRun", micro: Any) -> torch.Tensor:
    """The GRPO loss of one micro-batch (GA-scaled, with gradient), its metrics in the window (GRPOTrainer._compute_loss)."""
    config, plan, accelerator, trainer = run.config, run.plan, run.accelerator, run.trainer
    ga = plan.gradient_accumulation_steps
    b = micro.to(accelerator.device)
    bonus = run.entropy_controller
    with run.timer.phase("forward"), accelerator.autocast():
        out = policy_logprobs(run, run.model, b, entropy_grad=bonus is not None, with_aux_loss=run.aux_loss_coef != 0.0)
        token_keep = None
        if config.top_entropy_quantile < 1.0:
            token_keep = trainer.get_high_entropy_mask(out.entropy.detach(), b.loss_mask, 1.0 - config.top_entropy_quantile)
            token_keep = _checked_mask(token_keep, b.loss_mask.shape, "get_high_entropy_mask").bool() & b.loss_mask
        sequence_keep = None
        if config.off_policy_mask_threshold is not None:
            behaviour = b.sampler_logprobs if b.sampler_logprobs is not None else b.old_logprobs
            if behaviour is not None:  # on-policy without sampler logprobs: nothing drifted, nothing to drop
                sequence_keep = trainer.get_off_policy_mask(b.advantages.unsqueeze(1), out.logprobs, behaviour, b.loss_mask,
                                                            config.off_policy_mask_threshold)
                sequence_keep = _checked_mask(sequence_keep, (len(b), 1), "get_off_policy_mask").to(out.logprobs.dtype)
        loss, stats = policy_loss(
            config.loss_type, out.logprobs, b.old_logprobs, b.advantages, b.loss_mask, **run.loss_settings,
            grad_accum_steps=ga,
            token_denominator=dapo_denominator(
                micro.num_loss_tokens, num_processes=plan.num_processes, grad_accum_steps=ga, steps_per_generation=plan.steps_per_generation,
            ),
            ref_logprobs=b.ref_logprobs, sequence_keep=sequence_keep, token_keep=token_keep, sampler_weights=b.is_weights,
            entropy=out.entropy if bonus is not None else None, entropy_coef=bonus.applied_coef() if bonus is not None else 0.0,
        )
        if out.aux_loss is not None:
            loss = loss + run.aux_loss_coef * out.aux_loss / ga
            stats["aux_loss"] = out.aux_loss.detach()

    entropy = out.entropy.detach()
    run.window.add("entropy", global_mean(accelerator, masked_mean(entropy, b.loss_mask).item()))
    for name, value in stats.items():
        run.window.add(name, global_mean(accelerator, float(value)))
    if sequence_keep is not None:
        run.window.add("off_policy_mask/dropped_fraction", global_mean(accelerator, 1.0 - sequence_keep.mean().item()))
    if bonus is not None:
        effective = b.loss_mask if token_keep is None else b.loss_mask & token_keep
        bonus.observe(float((entropy * effective).sum()), float(effective.sum()))
    guard_loss(run, loss.item(), b.loss_mask, **{"policy log-probabilities": out.logprobs, "old log-probabilities": b.old_logprobs,
               "reference log-probabilities": b.ref_logprobs, "sampler weights": b.is_weights, "advantages": b.advantages})
    return loss


def policy_logprobs(run: "TrainingRun", model: torch.nn.Module, b: Any, *, rows_per_chunk: Optional[int] = None, with_entropy: bool = True,
                    entropy_grad: bool = False, with_aux_loss: bool = False) -> TokenLogprobs:
    """Logprobs (and entropy, aux loss) of a batch's completions under `model`: through the trainer's
    _get_per_token_logps_and_entropies when a subclass overrides it, else grouprl's `completion_logprobs`."""
    trainer = run.trainer
    if trainer is None or not trainer.overrides("_get_per_token_logps_and_entropies"):
        return completion_logprobs(
            model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, temperature=run.config.temperature,
            rows_per_chunk=rows_per_chunk, with_entropy=with_entropy, entropy_grad=entropy_grad, with_aux_loss=with_aux_loss,
            multimodal=b.multimodal, pack_prompts=run.config.pack_shared_prompts,
        )
    name = f"{type(trainer).__name__}._get_per_token_logps_and_entropies"
    if b.multimodal is not None:
        raise NotImplementedError(f"{name} is overridden, but this batch has images, which grouprl passes to the model its own way "
                                  "(not as TRL's pixel_values keyword arguments); remove the override for vision-language training.")
    width = b.completion_ids.shape[1]
    input_ids = torch.cat([b.prompt_ids, b.completion_ids], dim=1)
    attention_mask = torch.cat([b.prompt_mask, b.completion_mask], dim=1).long()
    result = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, width, batch_size=rows_per_chunk,
                                                          compute_entropy=with_entropy, compute_aux_loss=with_aux_loss)
    if not isinstance(result, tuple) or len(result) != 3:
        raise TypeError(f"{name} must return (per_token_logps, entropies, aux_loss) as TRL's does, got {type(result).__name__}.")
    logps, entropy, aux = result
    for label, value in (("per_token_logps", logps), ("entropies", entropy)):
        if value is not None and tuple(value.shape) != tuple(b.completion_ids.shape):
            raise ValueError(f"{name} returned {label} of shape {tuple(value.shape)}; expected {tuple(b.completion_ids.shape)} "
                             "(one value per completion position, logits_to_keep columns).")
    if with_entropy and entropy is None:
        raise ValueError(f"{name} returned no entropies although compute_entropy=True.")
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()
    return TokenLogprobs(logps, entropy if with_entropy else None, aux if with_aux_loss else None)


def _checked_mask(mask: Any, shape: tuple, method: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(shape):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"GRPOTrainer.{method} must return a tensor of shape {tuple(shape)} (as TRL's), got {got}.")
    return mask
