"""The policy and the reference model GRPOTrainer trains with: loaded, adapted (LoRA, quantized layers) and
made ready to train.

The seed is set right before the policy is loaded, so the random draws of a run do not depend on what the
constructor checked before.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from accelerate.utils import set_seed
from transformers import PreTrainedModel, enable_full_determinism

from grouprl.config.combinations import check_combinations
from grouprl.config.grpo_config import GRPOConfig
from grouprl.generation.vllm import require_vllm
from grouprl.model import quantization
from grouprl.model.adapters import add_reference_adapter, head_has_adapter, is_peft_model, require_peft, wrap_with_lora
from grouprl.model.loading import (
    cast_lm_head_to_fp32,
    disable_dropout,
    enable_checkpointing,
    load_model,
    router_aux_loss_coef,
)
from grouprl.model.reference import Reference, separate_reference_model


def load_policy(
    args: GRPOConfig,
    model: Any,
    *,
    use_peft: bool,
    peft_config: Any,
    quantization_config: Any,
    generation_backend: Any,
    features: set[str],
) -> tuple[PreTrainedModel, Optional[PreTrainedModel]]:
    """The policy (seeded, loaded, quantized as asked) and, with beta != 0 and no LoRA, a separate reference model."""
    if use_peft:
        require_peft()
    if args.use_vllm and args.vllm_mode == "colocate" and generation_backend is None:
        require_vllm("GRPOConfig.use_vllm=True (vllm_mode='colocate')")  # before any model is loaded
    policy_init_kwargs = quantization.with_quantization_config(args.model_init_kwargs, quantization_config)
    quantization.check_request(model, policy_init_kwargs, use_peft)
    enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
    policy = load_model(model, policy_init_kwargs, args.trust_remote_code)
    if quantization.is_quantized(policy) and "quantized" not in features:  # quantized by its own checkpoint's config
        check_combinations(features | {"quantized"})
    quantization.check_setup(policy, use_peft)
    if peft_config is not None and is_peft_model(policy):
        raise ValueError("model is already a PeftModel; pass either a PeftModel or peft_config, not both.")
    reference_model = None
    if args.beta != 0.0 and not use_peft:  # before any change to the policy
        reference_model = separate_reference_model(
            model, policy, lambda m: load_model(m, args.model_init_kwargs, args.trust_remote_code)
        )
    return policy, reference_model


def prepare_for_training(
    args: GRPOConfig,
    policy: PreTrainedModel,
    reference_model: Optional[PreTrainedModel],
    *,
    peft_config: Any,
    use_peft: bool,
    bf16_capable: bool,
) -> tuple[PreTrainedModel, Any, float]:
    """Dropout, fp32 head, checkpointing, LoRA adapters (and a frozen reference adapter), quantized-layer dtypes.

    Returns the policy (wrapped in its adapters with peft_config), the reference adapter (or None) and the
    MoE router's auxiliary-loss coefficient."""
    for prepared in (m for m in (policy, reference_model) if m is not None):
        if args.disable_dropout:
            disable_dropout(prepared)
        if args.cast_lm_head_to_fp32:
            if is_peft_model(prepared) and head_has_adapter(prepared):
                raise ValueError(
                    "cast_lm_head_to_fp32=True, but the LM head carries a LoRA adapter; take lm_head out of the "
                    "adapter's target_modules / modules_to_save, or leave cast_lm_head_to_fp32=False."
                )
            cast_lm_head_to_fp32(prepared)
    aux_loss_coef = router_aux_loss_coef(args.router_aux_loss_coef, policy)
    if args.gradient_checkpointing:
        enable_checkpointing(policy, args.gradient_checkpointing_kwargs or {"use_reentrant": False})
    policy.config.use_cache = False
    reference_adapter = None
    if peft_config is not None:
        policy = wrap_with_lora(policy, peft_config)
        if args.cast_lm_head_to_fp32 and head_has_adapter(policy):
            raise ValueError(
                "cast_lm_head_to_fp32=True, but peft_config puts an adapter on the LM head; take lm_head out of "
                "target_modules / modules_to_save, or leave cast_lm_head_to_fp32=False."
            )
    elif use_peft and args.beta != 0.0:  # a pre-wrapped adapter may be trained already: keep a frozen copy as pi_ref
        reference_adapter = add_reference_adapter(policy)
    quantization.prepare_policy(policy, bf16_capable=bf16_capable)
    return policy, reference_adapter, aux_loss_coef


def build_reference(
    args: GRPOConfig, reference_model: Optional[PreTrainedModel], reference_adapter: Any, device: torch.device
) -> tuple[Optional[Reference], Optional[PreTrainedModel]]:
    """(the Reference the objective reads, TRL's `ref_model` attribute); both None with beta=0."""
    if args.beta == 0.0:
        return None, None
    ref_model = reference_model.to(device) if reference_model is not None else None
    return Reference(model=ref_model, adapter=reference_adapter), ref_model
