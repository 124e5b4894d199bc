"""Entropy in the objective: the (adaptive) entropy bonus.

- *High-entropy tokens* ("Beyond the 80/20 rule", Wang et al. 2025), for reference: the policy term trains only
  on the top-rho fraction of loss tokens by entropy, the threshold being the (1 - rho) quantile of the
  entropies of every loss token of the micro-batch on every process (`high_entropy_mask`; TRL's override
  point `get_high_entropy_mask` replaces it).
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


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float, accelerator: Any) -> torch.Tensor:
    """(B, T) bool: the valid tokens (mask) whose entropy is at least the `threshold` quantile of the entropies
    of every valid token on every process (threshold = 1 - top_entropy_quantile). No valid token: all False."""
    local = entropies[mask.bool()].detach().float()
    # entropies are >= 0: -1 marks padding
    padded = accelerator.pad_across_processes(local, dim=0, pad_index=-1.0)
    gathered = accelerator.gather(padded)
    gathered = gathered[gathered >= 0]
    if gathered.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    cutoff = torch.quantile(gathered, float(threshold))
    return (entropies >= cutoff) & mask.bool()


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

    def applied_coef(self) -> float:
        """The coefficient every micro-step of the current optimizer step uses."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def end_step(self, global_sum: float, global_count: float) -> float:
        """At an optimizer-step boundary: update from the step's global entropy; returns the new coef."""
        if self.adaptive:
            entropy = global_sum / max(global_count, 1.0)
            if entropy <= self.target:
                self.coef = min(self.coef + self.delta, self.coef_max)
            else:
                self.coef = max(self.coef - self.delta, self.coef_min)
            self.last_entropy = entropy
        return self.coef

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
