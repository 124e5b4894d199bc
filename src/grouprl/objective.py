"""One micro-step: forward the policy on a micro-batch, build the GRPO objective, backward.

    forward (logprobs, entropy, MoE aux loss)
    -> high-entropy token mask (threshold over every process's loss tokens)
    -> off-policy sequence mask (behaviour = sampler logprobs if any, else pi_old)
    -> losses.policy_loss (objective, masks, sampler weights, KL, aggregation, entropy bonus)
    -> + router_aux_loss_coef * aux / GA
    -> backward, metrics
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .algorithms.entropy import entropy_threshold, high_entropy_mask
from .algorithms.masks import off_policy_mask
from .algorithms.logprobs import completion_logprobs
from .algorithms.losses import dapo_denominator, masked_mean, policy_loss
from .config import GRPOConfig
from .distributed import gather_varlen, global_mean
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
    )


def train_micro_batch(run: "TrainingRun", micro: Any) -> float:
    """Forward, loss and backward of one micro-batch; returns the (already GA-scaled) loss."""
    if len(micro) == 0:  # dynamic sampling kept fewer rows than micro-steps
        return 0.0
    config, plan, accelerator = run.config, run.plan, run.accelerator
    ga = plan.gradient_accumulation_steps
    b = micro.to(accelerator.device)
    bonus = run.entropy_controller
    with run.timer.phase("forward"), accelerator.autocast():
        out = completion_logprobs(
            run.model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, temperature=config.temperature,
            entropy_grad=bonus is not None, with_aux_loss=run.aux_loss_coef != 0.0, multimodal=b.multimodal,
        )
        token_keep = None
        if config.top_entropy_quantile < 1.0:
            valid = gather_varlen(accelerator, out.entropy.detach()[b.loss_mask])
            token_keep = high_entropy_mask(out.entropy, b.loss_mask, entropy_threshold(valid, config.top_entropy_quantile))
        sequence_keep = None
        if config.off_policy_mask_threshold is not None:
            behaviour = b.sampler_logprobs if b.sampler_logprobs is not None else b.old_logprobs
            if behaviour is not None:  # on-policy without sampler logprobs: nothing drifted, nothing to drop
                sequence_keep = off_policy_mask(out.logprobs, behaviour, b.advantages, b.loss_mask, threshold=config.off_policy_mask_threshold)
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
    with run.timer.phase("backward"):
        accelerator.backward(loss)

    entropy = out.entropy.detach()
    run.window.add("entropy", global_mean(accelerator, masked_mean(entropy, b.loss_mask).item()))
    for name, value in stats.items():
        run.window.add(name, global_mean(accelerator, float(value)))
    if sequence_keep is not None:
        run.window.add("off_policy_mask/dropped_fraction", global_mean(accelerator, 1.0 - sequence_keep.mean().item()))
    if bonus is not None:
        effective = b.loss_mask if token_keep is None else b.loss_mask & token_keep
        bonus.observe(float((entropy * effective).sum()), float(effective.sum()))
    value = loss.item()
    guard_loss(run, value, b.loss_mask, **{"policy log-probabilities": out.logprobs, "old log-probabilities": b.old_logprobs,
               "reference log-probabilities": b.ref_logprobs, "sampler weights": b.is_weights, "advantages": b.advantages})
    return value
