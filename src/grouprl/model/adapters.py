"""LoRA through `peft` (an optional dependency): wrapping, the reference adapter, saving, loading.

Only the adapter parameters train; the base weights stay frozen. With beta > 0 a LoRA policy
needs no second model: when grouprl created the adapter (``peft_config=``) it starts at zero, so
the reference policy is the base model, i.e. the policy with its adapters disabled. A pre-wrapped
``PeftModel`` may carry a trained adapter, so (as TRL) a frozen copy of it, the "ref" adapter, is
made at start-up and switched on for reference passes.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

REFERENCE_ADAPTER = "ref"
PEFT_MISSING = (
    "LoRA training (peft_config=... or a PeftModel) needs the `peft` package, which is not installed. "
    "Install it with: pip install 'grouprl[peft]'  (or: pip install peft)."
)


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError(PEFT_MISSING) from None
    return peft


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def base_model(model: Any) -> Any:
    """The model a PeftModel wraps; any other model itself."""
    return model.get_base_model() if is_peft_model(model) else model


def wrap_with_lora(model: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
    peft = require_peft()
    if not isinstance(peft_config, peft.PeftConfig):
        raise TypeError(
            f"peft_config must be a peft.PeftConfig (e.g. LoraConfig(...)), got {type(peft_config).__name__}."
        )
    return peft.get_peft_model(model, peft_config)


def active_adapter(model: Any) -> str:
    name = model.active_adapter
    return name if isinstance(name, str) else name[0]


def head_has_adapter(model: Any) -> bool:
    """True if the output embedding (LM head) of a PeftModel carries an adapter or a trained copy."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    head = model.get_output_embeddings()
    wrappers = (BaseTunerLayer, ModulesToSaveWrapper)
    if isinstance(head, wrappers):
        return True
    for module in model.modules():  # a wrapper whose wrapped (base) layer is the head
        if isinstance(module, wrappers) and any(child is head for child in module.modules()):
            return True
    return False


def config_targets_head(peft_config: Any, head_name: str = "lm_head") -> bool:
    """True if a PEFT config (before wrapping) puts an adapter, or a trained copy, on the LM head `head_name`."""
    targets = getattr(peft_config, "target_modules", None)
    if isinstance(targets, str):  # peft reads a string as a regular expression over module names
        on_head = re.fullmatch(targets, head_name) is not None
    else:
        on_head = any(t == head_name or str(t).endswith(f".{head_name}") for t in targets or ())
    return on_head or head_name in (getattr(peft_config, "modules_to_save", None) or ())


def add_reference_adapter(model: Any) -> Optional[str]:
    """Add a frozen copy of the active adapter as "ref"; return its name. None where peft allows no second adapter
    (LoRA on parameters, `target_parameters`, before peft 0.20) and the adapter adds nothing yet: the reference is
    then the policy with its adapters disabled, exactly."""
    source = active_adapter(model)
    config = model.peft_config[source]
    try:
        model.add_adapter(REFERENCE_ADAPTER, config)
    except ValueError as error:
        if not getattr(config, "target_parameters", None):
            raise
        if _adds_nothing(model, source):
            return None
        raise ValueError(
            f"GRPOConfig.beta > 0 needs the reference policy, and the PeftModel's adapter {source!r} is trained (its "
            "LoRA B matrices are not zero), so grouprl keeps a frozen copy of it as the reference; but this "
            f"{_peft_version()} refuses a second adapter on target_parameters ({error}). Upgrade peft (pip install -U "
            "peft; 0.20 allows it), or set beta=0.0."
        ) from error
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if f".{source}." in name:
                params[name.replace(f".{source}.", f".{REFERENCE_ADAPTER}.")].copy_(param)
    _freeze_reference(model)
    return REFERENCE_ADAPTER


def _adds_nothing(model: Any, adapter: str) -> bool:
    """Whether `adapter` is LoRA matrices only, every B still zero (peft's initialisation): its delta is zero."""
    trained = [(name, p) for name, p in model.named_parameters() if f".{adapter}." in name]
    return all(".lora_A." in name or ".lora_B." in name for name, _ in trained) and all(
        not p.any() for name, p in trained if ".lora_B." in name
    )


def _peft_version() -> str:
    import peft

    return f"peft {peft.__version__}"


def _freeze_reference(model: Any) -> None:
    for name, param in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in name:
            param.requires_grad_(False)


@contextmanager
def reference_mode(model: Any, adapter: Optional[str]) -> Iterator[None]:
    """Within: the PeftModel computes the reference policy (the "ref" adapter, or no adapter)."""
    if adapter is None:
        with model.disable_adapter():
            yield
        return
    trained = active_adapter(model)
    model.set_adapter(adapter, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(trained)  # makes the trained adapter trainable again, and the others frozen
        _freeze_reference(model)


def save_pretrained(model: Any, path: str, weights: Optional[dict] = None) -> None:
    """save_pretrained; a PeftModel writes only its trained adapter (adapter_config.json + weights). `weights`: the
    full weights of a sharded model (full_state.gather_full_state), written instead of the model's shards."""
    if is_peft_model(model):
        model.save_pretrained(
            path, safe_serialization=True, selected_adapters=[active_adapter(model)], state_dict=weights
        )
    else:
        model.save_pretrained(path, safe_serialization=True, state_dict=weights)


def load_adapter_weights(model: Any, path: str) -> None:
    """Load a checkpoint's adapter weights (written by `save_pretrained`) into the active adapter."""
    import os

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(path, "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights, adapter_name=active_adapter(model))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"Checkpoint {path} does not match the adapter: unexpected {unexpected[:5]}.")
