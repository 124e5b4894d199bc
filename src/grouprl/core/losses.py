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
`policy_loss` itself takes only what every loss shares.

The importance weights the objectives consume are computed here too, ahead of them: the policy ratio w
(`log_importance_weights`) and the sampler-mismatch correction rho (`sampler_importance_weights`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch

from grouprl.core.kl import k3_kl

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
    """What the aggregations divide by: this micro-step's share of the optimizer step."""

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


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is True (0 if nothing is masked in)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# ---- importance weights -------------------------------------------------------------------------
# Two different ratios appear in GRPO:
#
# 1. The *policy ratio* w = pi_theta / pi_old of the clipped surrogate. At token level (PPO, GRPO)
#    it is one ratio per token; at sequence level (GSPO, Zheng et al. 2025) it is the geometric mean
#    over the sequence's loss tokens, exp(mean_t log r_t), one value per row broadcast over tokens.
# 2. The *sampler correction* rho = pi_old(trainer) / pi_sampler: the generation engine (vLLM, a
#    server, ...) and the training forward never compute exactly the same probabilities, so samples
#    are slightly off-policy even before any update. Truncated importance sampling (TIS, Yao et al.
#    2025) clips rho; masked importance sampling (MIS / IcePop) zeroes tokens or sequences whose rho
#    leaves [C_min, C_max]. Sequence modes use the *product* of token ratios (a sum of log
#    differences, not a mean), as TRL 1.16 does.

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def log_importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log w from per-token log ratios (n, T): (n, T) for "token", (n, 1) for "sequence" (GSPO).

    The sequence weight is the length-normalised sum over loss tokens, so it keeps the gradient of
    every token (each gets 1 / length of it); a row without loss tokens gets log w = 0.
    """
    if level == "token":
        return log_ratio
    if level == "sequence":
        m = mask.to(log_ratio.dtype)
        return (log_ratio * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1.0)  # (n, 1)
    raise ValueError(f"importance_sampling_level={level!r} is not 'token' or 'sequence'.")


def sampler_importance_weights(
    old_logprobs: torch.Tensor,  # (n, T) logprobs of the sampled tokens under the trainer, at sampling time
    sampler_logprobs: torch.Tensor,  # (n, T) the same under the generation engine; NaN = not scored
    mask: torch.Tensor,  # (n, T) bool loss mask
    *,
    mode: str,
    clip_min: Optional[float],
    clip_max: Optional[float],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sampler-mismatch weights rho: (n, T) for token_* modes, (n, 1) for sequence_* modes.

    d = (old - sampler) on loss tokens (0 elsewhere and where the sampler gave no logprob);
    rho = exp(d) per token, or exp(sum_t d) per sequence; *_truncate clamps rho into
    [clip_min, clip_max] (a missing bound is open); *_mask sets rho to 0 outside that range.
    Returns rho and the sampling/* statistics TRL logs, plus grouprl's
    sampling/importance_sampling_masked_fraction: the share of loss tokens (token modes) or of
    sequences with loss tokens (sequence modes) whose weight is 0, i.e. that train nothing.
    """
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of {IS_MODES}.")
    valid = mask & torch.isfinite(sampler_logprobs)  # (n, T)
    diff = torch.where(valid, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs))  # (n, T)
    sequence_level = mode.startswith("sequence")
    log_rho = diff.sum(dim=1, keepdim=True) if sequence_level else diff  # (n, 1) | (n, T)
    rho = torch.exp(log_rho)
    if mode.endswith("truncate"):
        rho = torch.clamp(rho, min=clip_min, max=clip_max)
    else:
        outside = torch.zeros_like(rho, dtype=torch.bool)
        if clip_min is not None:
            outside |= rho < clip_min
        if clip_max is not None:
            outside |= rho > clip_max
        rho = rho.masked_fill(outside, 0.0)

    nan = float("nan")
    gaps = diff.abs()[valid]
    counted = rho[mask.any(dim=1)] if sequence_level else rho[mask]  # sequences with loss tokens | loss tokens
    stats = {
        "sampling/sampling_logp_difference/mean": gaps.mean().item() if gaps.numel() else nan,
        "sampling/sampling_logp_difference/max": gaps.max().item() if gaps.numel() else nan,
        "sampling/importance_sampling_ratio/min": counted.min().item() if counted.numel() else nan,
        "sampling/importance_sampling_ratio/mean": counted.mean().item() if counted.numel() else nan,
        "sampling/importance_sampling_ratio/max": counted.max().item() if counted.numel() else nan,
        "sampling/importance_sampling_masked_fraction": (counted == 0).float().mean().item()
        if counted.numel()
        else nan,
    }
    return rho, stats


# ---- objectives ---------------------------------------------------------------------------------
# Shared signature: (logprobs (n, T), log_ratio (n, T) token-level log pi - log pi_old, log_weights (n, T) | (n, 1)
# at the chosen level, advantages (n, 1), mask (n, T), *, sampler_weights, **its own hyper-parameters) -> (per-token
# loss (n, T) | (n, 1), stats). Each objective also returns its clip and ratio statistics under TRL's metric names.

VESPO_LOG_CLAMP = 20.0  # per-token and per-sequence log-ratio clamp of VESPO
VESPO_LOG_FLOOR = math.log(1e-8)  # lower clamp of the sequence log-weight and of log rho
VESPO_LAMBDA_FLOOR = 1e-4


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(overall fraction, per-row fractions) of `flags`: over loss tokens for (n, T) flags; over
    rows for sequence-level (n, 1) flags (TRL counts every row then)."""
    flags = flags.float()
    if flags.shape[1] == 1:
        return flags.mean(), flags.squeeze(1)
    tokens = mask.sum(dim=1)
    rows = tokens > 0
    return masked_mean(flags, mask), (flags * mask).sum(dim=1)[rows] / tokens[rows]


def _ratio_stats(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """grouprl's policy_ratio/* metrics: w over loss tokens (token level) or rows (sequence level)."""
    values = weights.detach().squeeze(1) if weights.shape[1] == 1 else weights.detach()[mask]
    nan = torch.tensor(float("nan"))
    if values.numel() == 0:
        return {"policy_ratio/mean": nan, "policy_ratio/min": nan, "policy_ratio/max": nan}
    return {"policy_ratio/mean": values.mean(), "policy_ratio/min": values.min(), "policy_ratio/max": values.max()}


def clipped_surrogate(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    log_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    delta: Optional[float] = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped objective -min(w' A, clip(w, 1 - eps_low, 1 + eps_high) A), w' = min(w, delta).

    The clipped branch uses the uncapped w; delta caps only the unclipped branch (INTELLECT-2).
    Clip statistics (with the capped w, as TRL): fraction clipped low (w < 1 - eps_low, A < 0), high
    (w > 1 + eps_high, A > 0) and either, as a mean and as the min/max over sequences.
    """
    weights = torch.exp(log_weights)
    clipped = torch.clamp(weights, 1.0 - epsilon_low, 1.0 + epsilon_high) * advantages
    capped = weights if delta is None else torch.clamp(weights, max=delta)
    per_token = -torch.minimum(capped * advantages, clipped)
    with torch.no_grad():
        low = (capped < 1.0 - epsilon_low) & (advantages < 0)
        high = (capped > 1.0 + epsilon_high) & (advantages > 0)
        low_mean, low_rows = _fraction(low, mask)
        high_mean, high_rows = _fraction(high, mask)
        region_mean, _ = _fraction(low | high, mask)
        nan = torch.tensor(float("nan"))
        stats = {
            "clip_ratio/low_mean": low_mean,
            "clip_ratio/high_mean": high_mean,
            "clip_ratio/region_mean": region_mean,
            "clip_ratio/low_min": low_rows.min() if low_rows.numel() else nan,
            "clip_ratio/high_max": high_rows.max() if high_rows.numel() else nan,
            **_ratio_stats(capped, mask),
        }
    return per_token, stats


def cispo_objective(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    log_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_high: float,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE on log pi weighted by the detached ratio capped at eps_high (no lower clip)."""
    weights = torch.exp(log_weights)
    capped = torch.clamp(weights, max=epsilon_high).detach()
    per_token = -capped * advantages * logprobs
    with torch.no_grad():
        fraction, _ = _fraction((weights > epsilon_high) & (advantages > 0), mask)
        stats = {"cispo_clip_ratio": fraction, **_ratio_stats(weights, mask)}
    return per_token, stats


def sapo_objective(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    log_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float,
    tau_neg: float,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate instead of a hard clip; at w = 1 its gradient equals the unclipped one."""
    weights = torch.exp(log_weights)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # A = 0 uses tau_neg
    per_token = -(4.0 / tau) * torch.sigmoid(tau * (weights - 1.0)) * advantages
    return per_token, _ratio_stats(weights, mask)


def gamma_weights(
    log_ratio: torch.Tensor,  # (n, T) token-level log pi - log pi_old
    advantages: torch.Tensor,  # (n, 1)
    mask: torch.Tensor,  # (n, T) bool
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    sampler_weights: Optional[torch.Tensor] = None,  # (n, T) token-level sampler-mismatch rho
) -> torch.Tensor:
    """VESPO's detached per-sequence weight phi (n, 1) = exp(lam + k log W - lam W), phi(1) = 1.

    log W = clamp(sum_t clamp(log r_t, +-20) [+ sum_t clamp(log rho_t, ln 1e-8, 20)], ln 1e-8, 20):
    a *sum* over the sequence's loss tokens (not a mean). (k, lam) are the positive-advantage pair
    for A >= 0, else the negative one; lam is floored at 1e-4; non-finite phi becomes 0.
    """
    with torch.no_grad():
        m = mask.to(log_ratio.dtype)
        log_w = (torch.clamp(log_ratio, -VESPO_LOG_CLAMP, VESPO_LOG_CLAMP) * m).sum(dim=1, keepdim=True)  # (n, 1)
        if sampler_weights is not None:
            log_rho = torch.clamp(torch.log(sampler_weights), VESPO_LOG_FLOOR, VESPO_LOG_CLAMP)
            log_w = log_w + (log_rho * m).sum(dim=1, keepdim=True)
        log_w = torch.clamp(log_w, VESPO_LOG_FLOOR, VESPO_LOG_CLAMP)
        positive = advantages >= 0
        k = torch.where(positive, k_pos, k_neg)
        lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=VESPO_LAMBDA_FLOOR)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def vespo_objective(
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    log_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    sampler_weights: Optional[torch.Tensor] = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO: REINFORCE on log pi weighted by the detached sequence-level Gamma kernel phi."""
    phi = gamma_weights(
        log_ratio,
        advantages,
        mask,
        k_pos=k_pos,
        lambda_pos=lambda_pos,
        k_neg=k_neg,
        lambda_neg=lambda_neg,
        sampler_weights=sampler_weights,
    )  # (n, 1)
    per_token = -phi * advantages * logprobs
    return per_token, {"vespo/phi_seq_mean": phi.mean(), **_ratio_stats(torch.exp(log_weights), mask)}


# ---- aggregations -------------------------------------------------------------------------------
# The (n, T) per-token loss -> the scalar of one micro-step, already divided for gradient accumulation
# (the table above says which loss_type uses which).


def sequence_mean_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, **_: object
) -> torch.Tensor:
    """grpo, sapo: each sequence's token mean, averaged over sequences."""
    m = mask.to(per_token.dtype)
    per_sequence = (per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return per_sequence.mean() / grad_accum_steps


def micro_batch_token_mean_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, **_: object
) -> torch.Tensor:
    """bnpo: token mean over the local micro-batch."""
    return masked_mean(per_token, mask) / grad_accum_steps


def constant_length_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, max_completion_length: int, **_: object
) -> torch.Tensor:
    """dr_grpo: token sum divided by a constant (rows x max_completion_length), free of length bias."""
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / (per_token.shape[0] * max_completion_length) / grad_accum_steps


def global_token_mean_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, token_denominator: float, **_: object
) -> torch.Tensor:
    """dapo, cispo, vespo: token sum over the global token count of the optimizer step (`dapo_denominator`)."""
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / max(token_denominator, 1.0)


def sequence_sum_aggregation(
    per_token: torch.Tensor, mask: torch.Tensor, *, grad_accum_steps: int, **_: object
) -> torch.Tensor:
    """luspo: each sequence's token sum (its mean loss times its length), averaged over sequences."""
    m = mask.to(per_token.dtype)
    return (per_token * m).sum(dim=1).mean() / grad_accum_steps


def dapo_denominator(
    loss_tokens_in_generation: float, *, num_processes: int, grad_accum_steps: int, steps_per_generation: int
) -> float:
    """D of TRL 1.16: loss tokens of the generation batch (all processes) / P * GA / spg.

    With spg == GA one generation feeds one optimizer step and D is the per-process share of its
    tokens, so after DDP averages gradients over processes the loss is the global token mean. The
    GA / spg factor keeps that true when one generation feeds several optimizer steps (spg > GA) or
    one optimizer step takes several generations (spg < GA).
    """
    return loss_tokens_in_generation / num_processes * grad_accum_steps / steps_per_generation


# ---- the registry -------------------------------------------------------------------------------

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
    one of the ``*_aggregation`` functions of ``grouprl.core.losses`` (default: GRPO's
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


# ---- the composition ----------------------------------------------------------------------------


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
