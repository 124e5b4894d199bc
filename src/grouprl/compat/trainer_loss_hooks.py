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

from grouprl.core.entropy import high_entropy_mask
from grouprl.core.masks import off_policy_sequence_mask
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
        """(B, T) bool: the valid tokens whose entropy is at least the `threshold` quantile over every process
        (entropy.high_entropy_mask)."""
        return high_entropy_mask(entropies, mask, threshold, self.accelerator)

    # DeepSeek-V3.2's off-policy sequence mask with TRL's arguments, static as TRL's: (B, 1) in mask's dtype
    get_off_policy_mask = staticmethod(off_policy_sequence_mask)
