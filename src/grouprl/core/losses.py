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
the aggregation, then the entropy bonus. ``LOSSES[loss_type]`` holds the per-loss pieces. Each loss owns its
hyper-parameters: its objective receives them as keywords (``params`` of `register_loss`), and the built-in
losses are registered below through the same `register_loss` as a user's, with ``config_fields`` naming the TRL
fields that set theirs (epsilon, delta, sapo_temperature_*, vespo_*); a user's loss reads ``loss_kwargs``.
`policy_loss` itself takes only what every loss shares. The objectives live in `loss_objectives.py`, the
aggregations in `loss_aggregations.py`; this module holds the registry and the composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

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

ObjectiveFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class LossSpec:
    """One ``loss_type``: its per-token objective, its aggregation, its settings and how the loop must treat them.

    Built by `register_loss` (whose docstring describes each piece); ``LOSSES`` maps names to specs.
    """

    objective: ObjectiveFn
    aggregate: Callable[..., torch.Tensor]
    divides_by_grad_accum: bool = True  # False: normalised by the global token count instead
    sampler_weights_in_loss: bool = True  # False: the objective uses the sampler weights itself (vespo)
    # False: a row's weight depends on its micro-batch's other rows (bnpo), so rows stay put
    regroupable: bool = True
    # The loss's own hyper-parameters and their defaults: the keywords its objective receives
    params: dict = field(default_factory=dict)
    # hyper-parameter -> the GRPOConfig attribute that sets it (the built-ins' TRL fields); the other
    # hyper-parameters are set by GRPOConfig.loss_kwargs
    config_fields: dict[str, str] = field(default_factory=dict)

    def settings(self, config: Any) -> dict[str, Any]:
        """The hyper-parameters of a run: the defaults, then the config fields named in ``config_fields``, then
        ``config.loss_kwargs`` (which `GRPOConfig` checks names only the others)."""
        from_fields = {name: getattr(config, attribute) for name, attribute in self.config_fields.items()}
        return {**self.params, **from_fields, **(getattr(config, "loss_kwargs", None) or {})}


@dataclass(frozen=True)
class LossScale:
    """What the aggregations divide by (`loss_aggregations.py`): this micro-step's share of the optimizer step."""

    grad_accum_steps: int
    max_completion_length: int  # dr_grpo's constant length
    token_denominator: float  # dapo, cispo, vespo: the optimizer step's loss tokens per process (dapo_denominator)


@dataclass(frozen=True)
class KLPenalty:
    """+ beta x k3 KL to the reference policy per token, x the importance weight w when bias-corrected (TRL)."""

    beta: float
    ref_logprobs: Optional[torch.Tensor]  # (n, T), needed when beta != 0
    bias_corrected: bool = True  # GRPOConfig.use_bias_correction_kl


@dataclass(frozen=True)
class TokenTerms:
    """What acts on every loss's per-token loss besides its objective, and the entropy bonus (None: off)."""

    sequence_keep: Optional[torch.Tensor] = None  # (n, 1) off-policy mask (1 keep, 0 drop)
    token_keep: Optional[torch.Tensor] = None  # (n, T) bool high-entropy mask
    sampler_weights: Optional[torch.Tensor] = None  # (n, T) | (n, 1) sampler-mismatch rho
    entropy: Optional[torch.Tensor] = None  # (n, T): given = the entropy bonus is on
    entropy_coef: float = 0.0


NO_TERMS = TokenTerms()
LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    objective: Optional[ObjectiveFn] = None,
    aggregate: Callable[..., torch.Tensor] = sequence_mean_aggregation,
    *,
    params: Optional[Mapping[str, Any]] = None,
    config_fields: Optional[Mapping[str, str]] = None,
    divides_by_grad_accum: bool = True,
    sampler_weights_in_loss: bool = True,
    regroupable: bool = True,
    replace: bool = False,
) -> Union[LossSpec, Callable[[ObjectiveFn], ObjectiveFn]]:
    """Make ``GRPOConfig(loss_type=name)`` available, from any module (call it before building the config).

    ``objective(logprobs, log_ratio, log_weights, advantages, mask, *, sampler_weights, **params) -> (per_token
    (n, T) or (n, 1), stats)`` receives the shared per-token inputs and the loss's own hyper-parameters: ``params``
    are their defaults, overridden by ``GRPOConfig.loss_kwargs`` (or, for those named in ``config_fields``
    {hyper-parameter: GRPOConfig attribute}, by that config field: how the built-in losses read epsilon, delta,
    sapo_temperature_pos, ...). It should accept ``**_``. Without ``objective``, ``register_loss(name, ...)`` is a
    decorator that registers the function it decorates and returns it unchanged.
    ``aggregate(per_token, mask, *, grad_accum_steps, max_completion_length, token_denominator) -> scalar``:
    one of the ``*_aggregation`` functions of ``grouprl.core.loss_aggregations`` (default: GRPO's
    sequence mean) or your own. ``divides_by_grad_accum=False`` when the aggregation normalises by the global
    token count; ``regroupable=False`` when a row's weight depends on the other rows of its micro-batch.
    """
    if objective is None:

        def decorate(function: ObjectiveFn) -> ObjectiveFn:
            register_loss(
                name,
                function,
                aggregate,
                params=params,
                config_fields=config_fields,
                divides_by_grad_accum=divides_by_grad_accum,
                sampler_weights_in_loss=sampler_weights_in_loss,
                regroupable=regroupable,
                replace=replace,
            )
            return function

        return decorate
    if not callable(objective) or not callable(aggregate):
        raise TypeError(f"register_loss({name!r}): objective and aggregate must be callables.")
    if name in LOSSES and not replace:
        raise ValueError(f"register_loss: loss_type {name!r} exists already; pass replace=True to redefine it.")
    params, config_fields = dict(params or {}), dict(config_fields or {})
    if "sampler_weights" in params or not set(config_fields) <= set(params):
        raise ValueError(
            f"register_loss({name!r}): 'sampler_weights' is a shared input, not a hyper-parameter, and every "
            "hyper-parameter in config_fields needs a default in params."
        )
    spec = LossSpec(
        objective,
        aggregate,
        divides_by_grad_accum=divides_by_grad_accum,
        sampler_weights_in_loss=sampler_weights_in_loss,
        regroupable=regroupable,
        params=params,
        config_fields=config_fields,
    )
    LOSSES[name] = spec
    return spec


# The built-in losses, registered as a user's loss is; their settings come from TRL's GRPOConfig fields.
# effective_epsilon_high is epsilon_high, or epsilon when epsilon_high is unset (TRL).
_CLIP = {"epsilon_low": 0.2, "epsilon_high": 0.2, "delta": None}
_CLIP_FIELDS = {"epsilon_low": "epsilon", "epsilon_high": "effective_epsilon_high", "delta": "delta"}
for _name, _aggregate, _options in (
    ("grpo", sequence_mean_aggregation, {}),
    ("bnpo", micro_batch_token_mean_aggregation, {"regroupable": False}),
    ("dr_grpo", constant_length_aggregation, {}),
    ("dapo", global_token_mean_aggregation, {"divides_by_grad_accum": False}),
):
    register_loss(_name, clipped_surrogate, _aggregate, params=_CLIP, config_fields=_CLIP_FIELDS, **_options)
register_loss(
    "cispo",
    cispo_objective,
    global_token_mean_aggregation,
    divides_by_grad_accum=False,
    params={"epsilon_high": 0.2},
    config_fields={"epsilon_high": "effective_epsilon_high"},
)
register_loss(
    "sapo",
    sapo_objective,
    sequence_mean_aggregation,
    params={"tau_pos": 1.0, "tau_neg": 1.05},
    config_fields={"tau_pos": "sapo_temperature_pos", "tau_neg": "sapo_temperature_neg"},
)
register_loss("luspo", clipped_surrogate, sequence_sum_aggregation, params=_CLIP, config_fields=_CLIP_FIELDS)
register_loss(
    "vespo",
    vespo_objective,
    global_token_mean_aggregation,
    divides_by_grad_accum=False,
    sampler_weights_in_loss=False,
    params={"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
    config_fields={name: f"vespo_{name}" for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")},
)


def policy_loss(
    loss_type: str,
    logprobs: torch.Tensor,  # (n, T) current policy, with gradient
    old_logprobs: Optional[torch.Tensor],  # (n, T) | None: on-policy, the ratio is 1 with gradient
    advantages: torch.Tensor,  # (n,)
    mask: torch.Tensor,  # (n, T) bool loss mask
    *,
    scale: LossScale,
    settings: Optional[Mapping[str, Any]] = None,  # the loss's own hyper-parameters over its defaults (LossSpec)
    importance_sampling_level: str = "token",
    kl: Optional[KLPenalty] = None,
    terms: TokenTerms = NO_TERMS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss of one micro-step for `loss_type`, and its statistics (TRL metric names)."""
    if loss_type not in LOSSES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; available: {', '.join(LOSSES)}.")
    spec = LOSSES[loss_type]
    unknown = sorted(set(settings or {}) - set(spec.params))
    if unknown:
        raise ValueError(
            f"policy_loss: loss_type {loss_type!r} has no hyper-parameter {unknown[0]!r}; "
            f"its hyper-parameters are {sorted(spec.params) or 'none'}."
        )
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
        sampler_weights=terms.sampler_weights,
        **{**spec.params, **(settings or {})},
    )
    per_token = per_token.expand_as(logprobs)  # (n, T); sequence-level terms broadcast over tokens
    if terms.sequence_keep is not None:
        per_token = per_token * terms.sequence_keep
    if terms.token_keep is not None:
        per_token = per_token * terms.token_keep.to(per_token.dtype)
    if terms.sampler_weights is not None and spec.sampler_weights_in_loss:
        per_token = per_token * terms.sampler_weights
    if kl is not None and kl.beta != 0.0:
        if kl.ref_logprobs is None:
            raise ValueError("policy_loss: beta != 0 needs ref_logprobs.")
        divergence = k3_kl(logprobs, kl.ref_logprobs)  # (n, T)
        if kl.bias_corrected:
            divergence = divergence * torch.exp(log_weights)  # the uncapped w, with its gradient
        per_token = per_token + kl.beta * divergence
        stats["kl"] = masked_mean(divergence.detach(), mask)
    ga = scale.grad_accum_steps
    loss = spec.aggregate(
        per_token,
        mask,
        grad_accum_steps=ga,
        max_completion_length=scale.max_completion_length,
        token_denominator=scale.token_denominator,
    )
    if terms.entropy is not None:
        stats["policy_loss"] = loss.detach() * (ga if spec.divides_by_grad_accum else 1)
        effective = mask if terms.token_keep is None else mask & terms.token_keep
        loss = loss - terms.entropy_coef * masked_mean(terms.entropy, effective) / ga
    return loss, stats
