"""Policy-gradient losses of the GRPO family, as pure functions plus one registry.

A loss is two pieces:

1. a *per-token objective* turning the policy's logprobs, importance weights w (token level, or
   sequence level for GSPO) and advantages A into a per-token loss:

   ==========  ==================================================================================
   clip        -min(w' A, clip(w, 1 - eps_low, 1 + eps_high) A), w' = min(w, delta) if delta is
               set (PPO, Schulman et al. 2017; GRPO; INTELLECT-2 two-sided clipping)
   cispo       -sg(min(w, eps_high)) A log pi  (MiniMax-M1; eps_high is an absolute cap here)
   sapo        -(4 / tau) sigmoid(tau (w - 1)) A, tau = tau_pos if A > 0 else tau_neg (SAPO, Qwen)
   vespo       -sg(phi) A log pi, phi = exp(lam + k log W - lam W) of the sequence ratio W
               (VESPO: a normalised Gamma kernel, phi(1) = 1)
   ==========  ==================================================================================

2. an *aggregation* turning the (n, T) loss into the scalar of one micro-step (TRL 1.16 semantics,
   already divided for gradient accumulation so that summing micro-step gradients gives the
   optimizer step's gradient):

   ===============  ===================================================================
   grpo, sapo       mean over sequences of the sequence's token mean, / GA (DeepSeekMath)
   bnpo             token mean over the micro-batch, / GA
   dr_grpo          token sum / (rows * max_completion_length), / GA (Dr. GRPO, Liu et al.)
   dapo, cispo,     token sum / D, D = loss tokens of the generation batch per process * GA
   vespo            / spg (DAPO, Yu et al. 2025): the token mean over the optimizer step
   luspo            mean over sequences of the sequence's token *sum*, / GA (LUSPO)
   ===============  ===================================================================

`policy_loss` composes them with everything else that acts per token, in TRL's order: the
objective, x the off-policy sequence mask, x the high-entropy token mask, x the sampler-mismatch
weights (not for vespo, which folds them into phi), + beta x k3 KL (x w when bias-corrected), then
the aggregation, then the entropy bonus. ``LOSSES[loss_type]`` holds the per-loss pieces; adding a
variant is one function and one entry. The objectives live in `loss_objectives.py`, the
aggregations in `loss_aggregations.py`; this module holds the registry and the composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from grouprl.core.importance import log_importance_weights
from grouprl.core.kl import k3_kl
from grouprl.core.loss_aggregations import (
    constant_length_aggregation,
    global_token_mean_aggregation,
    masked_mean,
    micro_batch_token_mean_aggregation,
    sequence_mean_aggregation,
    sequence_sum_aggregation,
)
from grouprl.core.loss_objectives import cispo_objective, clipped_surrogate, sapo_objective, vespo_objective


@dataclass(frozen=True)
class LossSpec:
    """One ``loss_type``: its per-token objective, its aggregation and how the loop must treat them.

    Built by `register_loss` (whose docstring describes each piece); ``LOSSES`` maps names to specs.
    """

    objective: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    aggregate: Callable[..., torch.Tensor]
    divides_by_grad_accum: bool = True  # False: normalised by the global token count instead
    sampler_weights_in_loss: bool = True  # False: the objective uses the sampler weights itself (vespo)
    # False: a row's weight depends on its micro-batch's other rows (bnpo), so rows stay put
    regroupable: bool = True
    # The loss's own hyper-parameters and defaults (GRPOConfig.loss_kwargs)
    params: dict = field(default_factory=dict)


LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec(clipped_surrogate, sequence_mean_aggregation),
    "bnpo": LossSpec(clipped_surrogate, micro_batch_token_mean_aggregation, regroupable=False),
    "dr_grpo": LossSpec(clipped_surrogate, constant_length_aggregation),
    "dapo": LossSpec(clipped_surrogate, global_token_mean_aggregation, divides_by_grad_accum=False),
    "cispo": LossSpec(cispo_objective, global_token_mean_aggregation, divides_by_grad_accum=False),
    "sapo": LossSpec(sapo_objective, sequence_mean_aggregation),
    "luspo": LossSpec(clipped_surrogate, sequence_sum_aggregation),
    "vespo": LossSpec(
        vespo_objective, global_token_mean_aggregation, divides_by_grad_accum=False, sampler_weights_in_loss=False
    ),
}


def register_loss(
    name: str,
    objective: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]],
    aggregate: Callable[..., torch.Tensor],
    *,
    params: Optional[dict] = None,
    divides_by_grad_accum: bool = True,
    sampler_weights_in_loss: bool = True,
    regroupable: bool = True,
    replace: bool = False,
) -> LossSpec:
    """Make ``GRPOConfig(loss_type=name)`` available, from any module (call it before building the config).

    ``objective(logprobs, log_ratio, log_weights, advantages, mask, **settings) -> (per_token (n, T) or (n, 1),
    stats)`` receives the built-in settings (epsilon_low, epsilon_high, delta, sampler_weights, ...) and the
    loss's own ``params`` (defaults here, overridden by ``GRPOConfig.loss_kwargs``); it should accept ``**_``.
    ``aggregate(per_token, mask, *, grad_accum_steps, max_completion_length, token_denominator) -> scalar``:
    one of the ``*_aggregation`` functions of ``grouprl.core.loss_aggregations`` or your own.
    ``divides_by_grad_accum=False`` when the aggregation normalises by the global token count;
    ``regroupable=False`` when a row's weight depends on the other rows of its micro-batch.
    """
    if not callable(objective) or not callable(aggregate):
        raise TypeError(f"register_loss({name!r}): objective and aggregate must be callables.")
    if name in LOSSES and not replace:
        raise ValueError(f"register_loss: loss_type {name!r} exists already; pass replace=True to redefine it.")
    spec = LossSpec(
        objective,
        aggregate,
        divides_by_grad_accum=divides_by_grad_accum,
        sampler_weights_in_loss=sampler_weights_in_loss,
        regroupable=regroupable,
        params=dict(params or {}),
    )
    LOSSES[name] = spec
    return spec


def policy_loss(
    loss_type: str,
    logprobs: torch.Tensor,  # (n, T) current policy, with gradient
    old_logprobs: Optional[torch.Tensor],  # (n, T) | None: on-policy, the ratio is 1 with gradient
    advantages: torch.Tensor,  # (n,)
    mask: torch.Tensor,  # (n, T) bool loss mask
    *,
    epsilon_low: float,
    epsilon_high: float,
    grad_accum_steps: int,
    max_completion_length: int,
    token_denominator: float,
    importance_sampling_level: str = "token",
    delta: Optional[float] = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    beta: float = 0.0,
    ref_logprobs: Optional[torch.Tensor] = None,  # (n, T), needed when beta != 0
    use_bias_correction_kl: bool = True,
    sequence_keep: Optional[torch.Tensor] = None,  # (n, 1) off-policy mask (1 keep, 0 drop)
    token_keep: Optional[torch.Tensor] = None,  # (n, T) bool high-entropy mask
    sampler_weights: Optional[torch.Tensor] = None,  # (n, T) | (n, 1) sampler-mismatch rho
    entropy: Optional[torch.Tensor] = None,  # (n, T): given = the entropy bonus is on
    entropy_coef: float = 0.0,
    loss_params: Optional[dict] = None,  # the loss's own hyper-parameters (GRPOConfig.loss_kwargs) over its defaults
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss of one micro-step for `loss_type`, and its statistics (TRL metric names)."""
    if loss_type not in LOSSES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; available: {', '.join(LOSSES)}.")
    spec = LOSSES[loss_type]
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    log_ratio = logprobs - old  # (n, T)
    log_weights = log_importance_weights(log_ratio, mask, importance_sampling_level)  # (n, T) | (n, 1)
    adv = advantages.unsqueeze(1)  # (n, 1)
    per_token, stats = spec.objective(
        logprobs,
        log_ratio,
        log_weights,
        adv,
        mask,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
        sampler_weights=sampler_weights,
        **{**spec.params, **(loss_params or {})},
    )
    per_token = per_token.expand_as(logprobs)  # (n, T); sequence-level terms broadcast over tokens
    if sequence_keep is not None:
        per_token = per_token * sequence_keep
    if token_keep is not None:
        per_token = per_token * token_keep.to(per_token.dtype)
    if sampler_weights is not None and spec.sampler_weights_in_loss:
        per_token = per_token * sampler_weights
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("policy_loss: beta != 0 needs ref_logprobs.")
        kl = k3_kl(logprobs, ref_logprobs)  # (n, T)
        if use_bias_correction_kl:
            kl = kl * torch.exp(log_weights)  # the uncapped w, with its gradient
        per_token = per_token + beta * kl
        stats["kl"] = masked_mean(kl.detach(), mask)
    loss = spec.aggregate(
        per_token,
        mask,
        grad_accum_steps=grad_accum_steps,
        max_completion_length=max_completion_length,
        token_denominator=token_denominator,
    )
    if entropy is not None:
        stats["policy_loss"] = loss.detach() * (grad_accum_steps if spec.divides_by_grad_accum else 1)
        effective = mask if token_keep is None else mask & token_keep
        loss = loss - entropy_coef * masked_mean(entropy, effective) / grad_accum_steps
    return loss, stats
