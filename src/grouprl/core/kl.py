"""The KL penalty against a reference policy: Schulman's k3 estimator.

For tokens sampled from pi_theta, k3 = exp(d) - d - 1 with d = log pi_ref - log pi_theta is an
unbiased, always non-negative estimate of KL(pi_theta || pi_ref) (http://joschu.net/blog/kl-approx.html),
the penalty GRPO adds per token (DeepSeekMath, Shao et al. 2024). When the samples come from an
older policy, multiplying k3 by the importance weight pi_theta / pi_old makes its gradient the
unbiased reverse-KL gradient (DeepSeek-V3.2's `use_bias_correction_kl`); that product is taken in
`losses.policy_loss`, where the weight is known.

d is clamped to [-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP] before exponentiating, so a token the
reference finds far more likely than the policy cannot overflow the loss (exp(20) ~ 5e8 stays
finite in bf16 and fp16-with-fp32-loss). Inside the clamp the value and gradient are exact.
"""

from __future__ import annotations

import torch

KL_LOG_RATIO_CLAMP = 20.0


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, clamp: float = KL_LOG_RATIO_CLAMP) -> torch.Tensor:
    """Per-token k3 estimate (n, T) of KL(pi_theta || pi_ref) from the sampled tokens' logprobs (n, T)."""
    d = torch.clamp(ref_logprobs - logprobs, min=-clamp, max=clamp)  # (n, T)
    return torch.exp(d) - d - 1.0
