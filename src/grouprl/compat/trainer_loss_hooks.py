"""TRL's override points inside the loss: the pieces the objective (micro_step.py) asks the trainer for.

    _get_per_token_logps_and_entropies(...)             the forward (called when overridden; text models)
    get_high_entropy_mask(entropies, mask, threshold)   top_entropy_quantile < 1
    get_off_policy_mask(advantages, logps, behaviour_logps, mask, threshold)  off_policy_mask_threshold set

The forward's default is grouprl's own logprob pass, which the objective runs directly when nobody
overrides it; this version (callable from an override through ``super()``) takes TRL's arguments.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from grouprl.core.masks import off_policy_mask
from grouprl.model.logprobs import completion_logprobs


class LossOverridePoints:
    """Expects ``self.args`` and ``self.accelerator``."""

    def _get_per_token_logps_and_entropies(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: Optional[int] = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(logps (B, logits_to_keep), entropies or None, MoE aux loss or None) of the last `logits_to_keep` tokens
        of `input_ids` (prompt left-padded, completion right-padded), at the training temperature. Text models
        only."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise NotImplementedError(
                f"_get_per_token_logps_and_entropies: grouprl passes images to the model its own way, not as "
                f"{', '.join(given)}; call it with text inputs only."
            )
        k = int(logits_to_keep)
        out = completion_logprobs(
            model,
            input_ids[:, :-k],
            attention_mask[:, :-k].bool(),
            input_ids[:, -k:],
            attention_mask[:, -k:].bool(),
            temperature=self.args.temperature,
            rows_per_chunk=batch_size,
            with_entropy=compute_entropy,
            entropy_grad=compute_entropy and torch.is_grad_enabled(),
            with_aux_loss=compute_aux_loss,
            pack_prompts=self.args.pack_shared_prompts,
        )
        return out.logprobs, out.entropy, out.aux_loss

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """(B, T) bool: the valid tokens (mask) whose entropy is at least the `threshold` quantile of the entropies
        of every valid token on every process (threshold = 1 - top_entropy_quantile). No valid token: all False."""
        local = entropies[mask.bool()].detach().float()
        # entropies are >= 0: -1 marks padding
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=-1.0)
        gathered = self.accelerator.gather(padded)
        gathered = gathered[gathered >= 0]
        if gathered.numel() == 0:
            return torch.zeros_like(mask, dtype=torch.bool)
        cutoff = torch.quantile(gathered, float(threshold))
        return (entropies >= cutoff) & mask.bool()

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """DeepSeek-V3.2's off-policy sequence mask, (B, 1) in mask's dtype: 1 keeps a sequence, 0 drops it
        (negative advantage and a mean log-ratio log pi_behaviour - log pi_theta over its valid tokens above the
        threshold; tokens the sampler did not score (NaN) count as 0). `advantages`: (B,) or (B, 1)."""
        if advantages.dim() == 2 and advantages.shape[1] == 1:
            advantages = advantages.squeeze(1)
        if advantages.dim() != 1:
            raise ValueError(f"get_off_policy_mask: advantages must be (B,) or (B, 1), got {tuple(advantages.shape)}.")
        keep = off_policy_mask(
            per_token_logps, sampling_per_token_logps, advantages, mask, threshold=off_policy_threshold
        )
        return keep.to(mask.dtype)
