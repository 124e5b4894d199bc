"""The GRPO objective of one micro-batch: forward the policy, build the loss, return it with its statistics.

    micro_batch_loss (GRPOTrainer._compute_loss) -> (loss, LossStats):
        forward (logprobs, entropy, MoE aux loss)   trainer._get_per_token_logps_and_entropies if overridden
        -> high-entropy token mask                  trainer.get_high_entropy_mask
                                                    (threshold over every process's loss tokens)
        -> off-policy sequence mask                 trainer.get_off_policy_mask
                                                    (behaviour = sampler logprobs if any, else pi_old)
        -> sampler gap / weights from this forward  samples trained once at the weights they were drawn or taken at:
                                                    pi_old is this forward's logprobs (experience.py skips its pass)
        -> losses.policy_loss (objective, masks, sampler weights, KL, aggregation, entropy bonus)
        -> + router_aux_loss_coef * aux / GA
        -> LossStats: the loss (must be finite), entropy, the loss function's statistics, each with its reduction

The named trainer methods are TRL's override points: a subclass's version is what runs. Nothing here reduces
across processes: the loop reduces every micro-batch's LossStats once per optimizer step (step_reduction.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch

from grouprl.config.grpo_config import BatchPlan, GRPOConfig
from grouprl.core.entropy import high_entropy_mask
from grouprl.core.losses import (
    LOSSES,
    KLPenalty,
    LossScale,
    TokenTerms,
    dapo_denominator,
    masked_mean,
    policy_loss,
    sampler_importance_weights,
)
from grouprl.core.masks import off_policy_sequence_mask
from grouprl.core.overrides import NO_OVERRIDES, Overrides
from grouprl.core.stats import MAX, MEAN, MIN, Stat, finite, local, mean, open_set, total
from grouprl.model.logprobs import policy_logprobs


@dataclass(frozen=True)
class Objective:
    """Everything the GRPO loss of a micro-batch takes from the config and the batch plan, built once per run."""

    loss_type: str
    loss_settings: dict[str, Any]  # the loss's own hyper-parameters (LossSpec.settings: its config fields, loss_kwargs)
    importance_sampling_level: str  # "token" or "sequence" (GSPO)
    max_completion_length: int
    beta: float  # the KL penalty's weight (0 = off)
    use_bias_correction_kl: bool
    temperature: float
    pack_shared_prompts: bool  # run a prompt shared by several rows once (model/prompt_packing.py)
    top_entropy_quantile: float
    off_policy_mask_threshold: Optional[float]
    aux_loss_coef: float  # MoE router load-balancing loss weight (0 = off)
    num_processes: int
    steps_per_generation: int
    # (mode, clip_min, clip_max) of the sampler-mismatch weights where the training forward computes them (experience)
    sampler_correction: tuple[str, Optional[float], Optional[float]] = ("token_truncate", None, None)

    @classmethod
    def from_config(cls, config: GRPOConfig, plan: BatchPlan, aux_loss_coef: float = 0.0) -> "Objective":
        return cls(
            loss_type=config.loss_type,
            loss_settings=LOSSES[config.loss_type].settings(config),
            importance_sampling_level=config.importance_sampling_level,
            max_completion_length=config.max_completion_length,
            beta=config.beta,
            use_bias_correction_kl=config.use_bias_correction_kl,
            temperature=config.temperature,
            pack_shared_prompts=config.pack_shared_prompts,
            top_entropy_quantile=config.top_entropy_quantile,
            off_policy_mask_threshold=config.off_policy_mask_threshold,
            aux_loss_coef=aux_loss_coef,
            num_processes=plan.num_processes,
            steps_per_generation=plan.steps_per_generation,
            sampler_correction=(
                config.vllm_importance_sampling_mode,
                config.vllm_importance_sampling_clip_min,
                config.vllm_importance_sampling_clip_max,
            ),
        )

    @property
    def sequence_level(self) -> bool:
        return self.importance_sampling_level == "sequence"

    def loss_scale(self, grad_accum_steps: int, token_denominator: float) -> LossScale:
        return LossScale(grad_accum_steps, self.max_completion_length, token_denominator)


@dataclass(frozen=True)
class LossStats:
    """One micro-batch's loss statistics (TRL's names), reduced by the loop once per optimizer step."""

    loss: Optional[torch.Tensor] = finite("loss")  # the micro-batch's loss: NaN / inf stops every process
    loss_inputs: Optional[dict[str, torch.Tensor]] = local()  # {readable name: 0-dim bool "finite on loss tokens"}
    tokens: Optional[torch.Tensor] = local()  # this micro-batch's loss tokens (the weight of token means)
    rows: Optional[float] = local()
    entropy: Optional[torch.Tensor] = mean("entropy", weight="tokens")  # model tokens only
    objective: dict[str, Stat] = open_set()  # the loss function's statistics (clip ratios, kl, ...)
    aux_loss: Optional[torch.Tensor] = mean("aux_loss")  # mean of per-process values, as TRL
    off_policy_dropped: Optional[torch.Tensor] = mean("off_policy_mask/dropped_fraction", weight="rows")
    entropy_sum: Optional[torch.Tensor] = total(None)  # for the entropy-bonus controller: its tokens' entropy
    entropy_count: Optional[torch.Tensor] = total(None)
    sampler: dict[str, Stat] = open_set()  # sampling/* when the sampler weights come from this forward


def objective_stats(values: dict[str, Any], tokens: torch.Tensor, rows: float, sequence_level: bool) -> dict[str, Stat]:
    """A loss function's statistics with their reductions, declared by name: ``*_min`` / ``*/min`` is a min and
    ``*_max`` / ``*/max`` a max over every process's rows (TRL's nanmin / nanmax); the rest are means over every
    process's loss tokens (TRL's global masked mean), over rows when the loss works per sequence, except
    ``policy_loss`` (the loss before the entropy bonus), a mean of per-process values."""
    out = {}
    for name, value in values.items():
        if name.endswith(("_min", "/min")):
            out[name] = Stat(value, MIN)
        elif name.endswith(("_max", "/max")):
            out[name] = Stat(value, MAX)
        elif name == "policy_loss":
            out[name] = Stat(value, MEAN)
        else:
            out[name] = Stat(value, MEAN, rows if sequence_level and name != "kl" else tokens)
    return out


def finite_on(tensor: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """0-dim bool: `tensor` has no NaN / inf (per-token tensors: on the loss tokens only); no host sync."""
    if tensor is None:
        return None
    values = tensor.detach()
    if values.shape == mask.shape:
        values = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.isfinite(values).all()


def micro_batch_loss(
    model: torch.nn.Module,
    micro: Any,
    objective: Objective,
    *,
    accelerator: Any,
    accumulation_steps: int,
    overrides: Overrides = NO_OVERRIDES,
    timer: Any = None,
    entropy_coef: Optional[float] = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO loss of one micro-batch (scaled to its share of the optimizer step, with gradient) and its
    statistics (GRPOTrainer._compute_loss).

    `accumulation_steps`: the micro-batches of this optimizer step (gradient_accumulation_steps, fewer in an
    epoch's last step); `overrides`: the user's versions of the forward and the two masks, if any; `entropy_coef`:
    the entropy bonus's coefficient (None: off).
    """
    ga = accumulation_steps
    b = micro.to(accelerator.device)
    bonus = entropy_coef is not None
    with timer.phase("forward") if timer is not None else nullcontext(), accelerator.autocast():
        out = policy_logprobs(
            model,
            b,
            temperature=objective.temperature,
            pack_prompts=objective.pack_shared_prompts,
            entropy_grad=bonus,
            with_aux_loss=objective.aux_loss_coef != 0.0,
            overrides=overrides,
        )
        token_keep = None
        if objective.top_entropy_quantile < 1.0:
            threshold = 1.0 - objective.top_entropy_quantile
            override = overrides.get("get_high_entropy_mask")
            token_keep = (
                override(out.entropy.detach(), b.loss_mask, threshold)
                if override
                else high_entropy_mask(out.entropy.detach(), b.loss_mask, threshold, accelerator)
            )
            token_keep = (
                _checked_mask(token_keep, b.loss_mask.shape, "get_high_entropy_mask", b.loss_mask.device).bool()
                & b.loss_mask
            )
        sequence_keep = None
        if objective.off_policy_mask_threshold is not None:
            behaviour = b.sampler_logprobs if b.sampler_logprobs is not None else b.old_logprobs
            if behaviour is not None:  # on-policy without sampler logprobs: nothing drifted, nothing to drop
                sequence_keep = (overrides.get("get_off_policy_mask") or off_policy_sequence_mask)(
                    b.advantages.unsqueeze(1), out.logprobs, behaviour, b.loss_mask, objective.off_policy_mask_threshold
                )
                sequence_keep = _checked_mask(
                    sequence_keep, (len(b), 1), "get_off_policy_mask", out.logprobs.device
                ).to(out.logprobs.dtype)
        sampler_weights, sampler_stats = b.is_weights, {}
        if b.sampler_in_forward is not None and b.sampler_logprobs is not None and b.is_weights is None:
            weights, sampler_stats = weights_from_forward(out.logprobs, b, objective.sampler_correction)
            sampler_weights = weights if b.sampler_in_forward == "correct" else None
        loss, values = policy_loss(
            objective.loss_type,
            out.logprobs,
            b.old_logprobs,
            b.advantages,
            b.loss_mask,
            scale=objective.loss_scale(
                ga,
                dapo_denominator(
                    micro.num_loss_tokens,
                    num_processes=objective.num_processes,
                    grad_accum_steps=ga,
                    steps_per_generation=objective.steps_per_generation,
                ),
            ),
            settings=objective.loss_settings,
            importance_sampling_level=objective.importance_sampling_level,
            kl=KLPenalty(objective.beta, b.ref_logprobs, objective.use_bias_correction_kl),
            terms=TokenTerms(
                sequence_keep=sequence_keep,
                token_keep=token_keep,
                sampler_weights=sampler_weights,
                entropy=out.entropy if bonus else None,
                entropy_coef=entropy_coef if bonus else 0.0,
            ),
        )
        if out.aux_loss is not None:
            loss = loss + objective.aux_loss_coef * out.aux_loss / ga

    entropy = out.entropy.detach()
    tokens = b.loss_mask.sum()
    effective = b.loss_mask if token_keep is None else b.loss_mask & token_keep
    inputs = {
        "policy log-probabilities": out.logprobs,
        "old log-probabilities": b.old_logprobs,
        "reference log-probabilities": b.ref_logprobs,
        "sampler weights": sampler_weights,
        "advantages": b.advantages,
    }
    stats = LossStats(
        loss=loss.detach(),
        loss_inputs={name: finite_on(value, b.loss_mask) for name, value in inputs.items() if value is not None},
        tokens=tokens,
        rows=float(len(b)),
        entropy=masked_mean(entropy, b.loss_mask),
        objective=objective_stats(values, tokens, float(len(b)), objective.sequence_level),
        aux_loss=out.aux_loss.detach() if out.aux_loss is not None else None,
        off_policy_dropped=1.0 - sequence_keep.mean() if sequence_keep is not None else None,
        entropy_sum=(entropy * effective).sum() if bonus else None,
        entropy_count=effective.sum() if bonus else None,
        sampler=sampler_stats,
    )
    return loss, stats


def weights_from_forward(
    logprobs: torch.Tensor, b: Any, correction: tuple[str, Optional[float], Optional[float]]
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """Sampler-mismatch weights (n, T) with pi_old = this forward's logprobs (detached), and their statistics:
    means over the loss tokens (sequences, for sequence modes), min / max over every process's rows."""
    mode, clip_min, clip_max = correction
    rho, values = sampler_importance_weights(
        logprobs.detach().float(),
        b.sampler_logprobs.float(),
        b.loss_mask,
        mode=mode,
        clip_min=clip_min,
        clip_max=clip_max,
    )
    tokens, sequences = b.loss_mask.sum(), b.loss_mask.any(dim=1).sum()
    counted = sequences if mode.startswith("sequence") else tokens
    weights = {"sampling/sampling_logp_difference/mean": tokens, "sampling/importance_sampling_ratio/mean": counted}
    weights["sampling/importance_sampling_masked_fraction"] = counted
    stats = {
        name: Stat(
            value, MIN if name.endswith("/min") else MAX if name.endswith("/max") else MEAN, weights.get(name, 1.0)
        )
        for name, value in values.items()
    }
    return rho.expand_as(logprobs).to(logprobs.dtype), stats


def _checked_mask(mask: Any, shape: tuple, method: str, device: torch.device) -> torch.Tensor:
    """A user override's mask, checked for shape and moved to the loss's device (a mask built on the CPU is common)."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(shape):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"GRPOTrainer.{method} must return a tensor of shape {tuple(shape)} (as TRL's), got {got}.")
    return mask.to(device)
