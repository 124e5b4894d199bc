"""QLoRA: the base model loaded quantized (bitsandbytes 4-bit or 8-bit), trained through LoRA adapters.

How a quantization config reaches the model, as in TRL: the trainer's ``quantization_config=``
argument, or ``GRPOConfig.model_init_kwargs["quantization_config"]`` (a ``BitsAndBytesConfig`` or
its dict); ``grouprl train --load_in_4bit`` builds the former. The config only applies when the
model is loaded here, from an id / path; a checkpoint saved quantized loads quantized on its own.

Quantized weights have no gradient, so a quantized policy trains only with adapters
(``peft_config``, or a ``PeftModel``); without them the trainer refuses it, as transformers' Trainer
does. The reference policy is then the base with the adapters off (``adapters.reference_mode``),
so no second quantized copy is loaded, and ``save_model`` writes the adapter only.

Adapter dtype: TRL keeps the adapters of a bitsandbytes-quantized model in bf16, the QLoRA paper's
choice. On a CPU without native bf16 units, where grouprl already trains in fp32 instead of TRL's
bf16 (``core.cpu_capabilities.native_bf16``), they stay in fp32: emulated bf16 products are ~100x slower,
and fp32 keeps updates that bf16 would round away.

peft's ``prepare_model_for_kbit_training`` is not called, as in TRL's GRPOTrainer: the adapters are
the only trainable parameters anyway, the non-quantized weights are already in the loading dtype
(float32 by default), and gradient checkpointing is the config's ``gradient_checkpointing``.

grouprl's own fast paths need nothing special: the in-process sampler (generation/engine.py) and
its weight-major CPU products (which leave quantized layers, subclasses of nn.Linear, alone), the
chunked logprobs with the hand-written LM-head backward (the head is never quantized by
transformers) and prompt packing run on bitsandbytes layers and match the plain paths
(tests/test_qlora.py). A separate engine (a generation server, vLLM, an asynchronous worker) is sent the base
dequantized with the adapters' update added (generation/weights.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers.utils import logging

from grouprl.model.adapters import base_model

logger = logging.get_logger("grouprl")

QUANTIZATION_KEY = "quantization_config"
BITSANDBYTES_MISSING = (
    "Loading a model in 4 or 8 bits needs the `bitsandbytes` package, which is not installed. "
    "Install it with: pip install 'grouprl[quantization]'  (or: pip install bitsandbytes)."
)


def with_quantization_config(model_init_kwargs: Optional[dict], quantization_config: Any) -> Optional[dict]:
    """`model_init_kwargs` with the trainer's `quantization_config` added (TRL: set it in one place only)."""
    if quantization_config is None:
        return model_init_kwargs
    kwargs = dict(model_init_kwargs or {})
    if kwargs.get(QUANTIZATION_KEY) is not None:
        raise ValueError(
            "quantization_config is set both as a GRPOTrainer argument and in GRPOConfig.model_init_kwargs; "
            "set it in one place only (preferably the trainer argument)."
        )
    kwargs[QUANTIZATION_KEY] = quantization_config
    return kwargs


def requested(model_init_kwargs: Optional[dict]) -> Any:
    """The quantization config `model_init_kwargs` asks for (a config object or a dict), or None."""
    return (model_init_kwargs or {}).get(QUANTIZATION_KEY)


def check_request(model: Any, model_init_kwargs: Optional[dict], use_peft: bool) -> None:
    """Before loading: refuse a quantization request that could not train, or that would be dropped."""
    config = requested(model_init_kwargs)
    if (
        config is None or describe(config) == "gguf"
    ):  # how a GGUF file is unpacked, not a quantization: gguf.dense_loading_kwargs checks it
        return
    if not isinstance(model, str):
        logger.warning(
            "quantization_config (trainer argument or model_init_kwargs) is ignored: the model is already "
            "instantiated. Load it quantized yourself, or pass its id / path as `model`."
        )
        return
    if not use_peft:
        raise ValueError(_NO_ADAPTERS.format(what=f"quantization_config ({describe(config)})"))
    if describe(config).startswith("bitsandbytes"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ImportError(BITSANDBYTES_MISSING) from None


def is_quantized(model: Any) -> bool:
    """True if the model's (or a PeftModel's base) weights were quantized at loading."""
    base = base_model(model)
    return bool(
        getattr(base, "is_quantized", False)
        or getattr(base, "is_loaded_in_4bit", False)
        or getattr(base, "is_loaded_in_8bit", False)
    )


def is_bitsandbytes_quantized(model: Any) -> bool:
    base = base_model(model)
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def check_setup(model: Any, use_peft: bool) -> None:
    """After loading: a quantized model trains only through adapters, and only if its method supports it (where it may
    sample is a feature combination: combinations.py)."""
    if not is_quantized(model):
        return
    base = base_model(model)
    quantizer = getattr(base, "hf_quantizer", None)
    if not use_peft and not getattr(quantizer, "is_qat_trainable", False):
        raise ValueError(_NO_ADAPTERS.format(what=f"the model is quantized ({describe(base)})"))
    if quantizer is not None and not quantizer.is_trainable:
        raise ValueError(
            f"The model is quantized with {describe(base)}, which does not support training (not even of adapters). "
            "Load it with bitsandbytes instead (quantization_config=BitsAndBytesConfig(load_in_4bit=True))."
        )


_NO_ADAPTERS = (
    "{what}, but there is no peft_config: quantized weights cannot be trained directly. Pass "
    "peft_config=LoraConfig(...) (grouprl train: --use_peft) to train LoRA adapters on the quantized base "
    "(QLoRA), or load the model without quantization."
)


def describe(source: Any) -> str:
    """'bitsandbytes 4-bit' / 'bitsandbytes 8-bit' / the quant method, of a model or of a
    quantization config (object or dict)."""
    if isinstance(source, torch.nn.Module):
        base = base_model(source)
        source = getattr(getattr(base, "hf_quantizer", None), "quantization_config", None)
    get = source.get if isinstance(source, dict) else (lambda key, default=None: getattr(source, key, default))
    if get("load_in_4bit"):
        return "bitsandbytes 4-bit"
    if get("load_in_8bit"):
        return "bitsandbytes 8-bit"
    method = get("quant_method", "unknown method")
    return str(getattr(method, "value", method))


def prepare_policy(model: torch.nn.Module, bf16_capable: bool) -> None:
    """Ready a quantized policy (with its adapters attached) for training; a no-op for other models."""
    if not is_bitsandbytes_quantized(model):
        return
    keep_training_layout(model)
    if bf16_capable:
        cast_adapters_to_bf16(model)


def keep_training_layout(model: torch.nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel.

    On a CPU with AVX512-BF16, bitsandbytes >= 0.49 repacks a Linear4bit's weight the first time the
    layer runs in eval mode without gradients (generation, old/reference logprobs), and from then on
    runs every call, training ones included, through an inference-only kernel: the backward through
    the layer then fails ("a view of a leaf Variable ... in-place") or loses the input gradient the
    adapters below need. Training passes must use the dequantize-and-matmul path, so the policy's
    layers never repack (measured on this project's machine: see tests/test_qlora.py).
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def cast_adapters_to_bf16(model: torch.nn.Module) -> None:
    """Trainable adapter weights in bf16, as TRL does for a bitsandbytes-quantized model (module doc).

    The DoRA magnitude vector stays as it is: its updates are often smaller than bf16 can represent
    next to its value, which would freeze it (TRL does the same).
    """
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)
