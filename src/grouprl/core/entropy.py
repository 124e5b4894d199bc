"""Entropy in the objective: high-entropy token selection and the (adaptive) entropy bonus.

- *High-entropy tokens* ("Beyond the 80/20 rule", Wang et al. 2025): train the policy term only
  on the top-rho fraction of loss tokens by entropy. The threshold is the (1 - rho) quantile
  (linear interpolation, as ``torch.quantile``) of the entropies of every loss token of the
  micro-batch on every process; a token is kept if its entropy >= threshold. rho = 1 disables,
  rho = 0 keeps only the maximum-entropy token(s).
- *Entropy bonus*: loss -= c * H_bar / GA, with H_bar the mean entropy over the (entropy-masked)
  loss tokens of the micro-batch; computed in `losses.policy_loss`.
- *Adaptive coefficient* (Skywork-OR1, He et al. 2025): the bonus applied during an optimizer step
  is c if the previous step's global mean entropy was <= target, else 0 (no bonus before the first
  measurement). At each optimizer-step boundary c moves by +delta when that step's entropy was at
  or below the target, -delta otherwise, within [c_min, c_max]. `EntropyController` holds this
  state; its `state_dict` goes into every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def entropy_threshold(valid_entropies: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """Entropy a token needs to be among the top `top_quantile` fraction; +inf if there is no token."""
    if valid_entropies.numel() == 0:
        return torch.tensor(float("inf"))
    return torch.quantile(valid_entropies.float(), 1.0 - top_quantile)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """(n, T) bool: loss tokens whose entropy (n, T) is at least `threshold`."""
    return (entropy.detach() >= threshold.to(entropy.device)) & mask


@dataclass
class EntropyController:
    """The entropy-bonus coefficient: constant, or Skywork-OR1's adaptive controller."""

    coef: float
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0
    last_entropy: float = math.inf  # global mean entropy of the previous optimizer step
    window_sum: float = 0.0  # entropy sum and token count of this optimizer step so far (this process)
    window_count: float = 0.0

    def applied_coef(self) -> float:
        """The coefficient every micro-step of the current optimizer step uses."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, entropy_sum: float, token_count: float) -> None:
        self.window_sum += entropy_sum
        self.window_count += token_count

    def end_step(self, global_sum: float, global_count: float) -> float:
        """At an optimizer-step boundary: update from the step's global entropy; returns the new coef."""
        if self.adaptive:
            entropy = global_sum / max(global_count, 1.0)
            if entropy <= self.target:
                self.coef = min(self.coef + self.delta, self.coef_max)
            else:
                self.coef = max(self.coef - self.delta, self.coef_min)
            self.last_entropy = entropy
        self.window_sum = self.window_count = 0.0
        return self.coef

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
        self.window_sum = self.window_count = 0.0
