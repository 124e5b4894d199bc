"""A deliberately slow reference of `grouprl.core.losses.policy_loss`: one token at a time.

Written straight from the formulas of the TRL semantics reference (§2.1, §2.2, §2.8-§2.10), with
Python loops over rows and tokens and 0-d tensors (so autograd still gives gradients). It shares
no code with the batched implementation.
"""

import math

import torch

CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _scalar_min(a, b):
    return a if a <= b else b


def reference_policy_loss(
    loss_type,
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    epsilon_low,
    epsilon_high,
    grad_accum_steps,
    max_completion_length,
    token_denominator,
    importance_sampling_level="token",
    delta=None,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    beta=0.0,
    ref_logprobs=None,
    use_bias_correction_kl=True,
    sequence_keep=None,
    token_keep=None,
    sampler_weights=None,
    entropy=None,
    entropy_coef=0.0,
):
    n, width = logprobs.shape
    zero = logprobs.sum() * 0.0
    losses = {}  # (i, t) -> per-token loss, loss tokens only
    for i in range(n):
        tokens = [t for t in range(width) if bool(mask[i, t])]
        log_ratio = []
        for t in range(width):
            old = logprobs[i, t].detach() if old_logprobs is None else old_logprobs[i, t]
            log_ratio.append(logprobs[i, t] - old)
        if importance_sampling_level == "sequence":
            total = zero
            for t in tokens:
                total = total + log_ratio[t]
            sequence_log_w = total / max(1, len(tokens))
            log_w = [sequence_log_w] * width
        else:
            log_w = log_ratio
        a = float(advantages[i])
        phi = None
        if loss_type == "vespo":
            s = 0.0
            for t in tokens:
                s += min(max(float(log_ratio[t].detach()), -20.0), 20.0)
                if sampler_weights is not None:
                    rho = float(sampler_weights[i, t])
                    s += min(max(math.log(rho) if rho > 0 else -math.inf, math.log(1e-8)), 20.0)
            s = min(max(s, math.log(1e-8)), 20.0)
            k, lam = (vespo_k_pos, vespo_lambda_pos) if a >= 0 else (vespo_k_neg, vespo_lambda_neg)
            lam = max(lam, 1e-4)
            phi = math.exp(lam + k * s - lam * math.exp(s))
            if not math.isfinite(phi):
                phi = 0.0
        for t in tokens:
            w = torch.exp(log_w[t])
            w_value = float(w.detach())
            if loss_type in CLIP_FAMILY:
                clipped = min(max(w_value, 1.0 - epsilon_low), 1.0 + epsilon_high)  # a constant where it binds
                clipped_w = (
                    w if 1.0 - epsilon_low <= w_value <= 1.0 + epsilon_high else torch.tensor(clipped, dtype=w.dtype)
                )
                capped = w if delta is None or w_value <= delta else torch.tensor(delta, dtype=w.dtype)
                loss = -_scalar_min(capped * a, clipped_w * a)
            elif loss_type == "cispo":
                loss = -min(w_value, epsilon_high) * a * logprobs[i, t]
            elif loss_type == "sapo":
                tau = sapo_temperature_pos if a > 0 else sapo_temperature_neg
                loss = -(4.0 / tau) * torch.sigmoid(tau * (w - 1.0)) * a
            elif loss_type == "vespo":
                loss = -phi * a * logprobs[i, t]
            else:
                raise ValueError(loss_type)
            if sequence_keep is not None:
                loss = loss * float(sequence_keep[i])
            if token_keep is not None:
                loss = loss * float(token_keep[i, t])
            if sampler_weights is not None and loss_type != "vespo":
                loss = loss * float(sampler_weights[i, t])
            if beta != 0.0:
                d = torch.clamp(ref_logprobs[i, t] - logprobs[i, t], -20.0, 20.0)
                kl = torch.exp(d) - d - 1.0
                if use_bias_correction_kl:
                    kl = kl * w
                loss = loss + beta * kl
            losses[(i, t)] = loss

    def row_sum(i):
        total = zero
        for (row, _), value in losses.items():
            if row == i:
                total = total + value
        return total

    total = zero
    for value in losses.values():
        total = total + value
    count = len(losses)
    if loss_type in ("grpo", "sapo"):
        result = zero
        for i in range(n):
            result = result + row_sum(i) / max(1, int(mask[i].sum()))
        result = result / n / grad_accum_steps
    elif loss_type == "bnpo":
        result = total / max(1, count) / grad_accum_steps
    elif loss_type == "dr_grpo":
        result = total / (n * max_completion_length) / grad_accum_steps
    elif loss_type == "luspo":
        result = zero
        for i in range(n):
            result = result + row_sum(i)
        result = result / n / grad_accum_steps
    else:  # dapo, cispo, vespo
        result = total / max(token_denominator, 1.0)
    if entropy is not None:
        bonus, kept = zero, 0
        for i in range(n):
            for t in range(width):
                if bool(mask[i, t]) and (token_keep is None or bool(token_keep[i, t])):
                    bonus = bonus + entropy[i, t]
                    kept += 1
        result = result - entropy_coef * (bonus / max(1, kept)) / grad_accum_steps
    return result
