"""Loading and preparing the policy (and reference) model and the tokenizer, as TRL does.

Model-level options live here: the default dtype (float32), dropout off, the LM head in fp32
(ScaleRL), activation checkpointing, EOS ids, and the MoE router aux-loss coefficient. A
vision-language checkpoint (its config has a ``vision_config``) loads with
AutoModelForImageTextToText and its processor with AutoProcessor.
"""

from __future__ import annotations

import os
import types
from typing import Any, Optional

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
)

from grouprl.model import gguf
from grouprl.model.adapters import is_peft_model
from grouprl.model.multimodal import is_vision_language_config, text_tokenizer


def load_model(model: Any, model_init_kwargs: Optional[dict], trust_remote_code: bool) -> PreTrainedModel:
    """A PreTrainedModel as given, or loaded from an id / path with `model_init_kwargs` (dtype float32 by default)."""
    if isinstance(model, PreTrainedModel) or is_peft_model(model):
        return gguf.as_plain_model(model)  # a GGUF-loaded instance saves as an ordinary checkpoint
    if not isinstance(model, str):
        raise TypeError(
            f"model must be a model id / path (str) or a transformers PreTrainedModel, got {type(model).__name__}."
        )
    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", "float32"))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    if kwargs.get(gguf.GGUF_KEY):
        gguf.require_gguf_package(f"model_init_kwargs[{gguf.GGUF_KEY!r}]={kwargs[gguf.GGUF_KEY]!r}")
        kwargs = gguf.dense_loading_kwargs(kwargs)
    check_local_model_path(model)
    try:
        hub_kwargs = {
            k: kwargs[k]
            for k in ("revision", "cache_dir", "token", "local_files_only", "subfolder", gguf.GGUF_KEY)
            if k in kwargs
        }
        config = AutoConfig.from_pretrained(model, trust_remote_code=kwargs["trust_remote_code"], **hub_kwargs)
        auto = AutoModelForImageTextToText if is_vision_language_config(config) else AutoModelForCausalLM
        return gguf.as_plain_model(auto.from_pretrained(model, dtype=dtype, **kwargs))
    except OSError as err:
        parent = os.path.dirname(model.rstrip("/"))
        if parent and os.path.isdir(parent) and not os.path.exists(model):  # "models/tiny-qwn", with models/ here
            raise OSError(
                f"Could not load the model {model!r}: there is no local directory {os.path.abspath(model)} (the "
                f"directory {parent!r} exists: check the name), and loading it as a Hub id failed too: {err}"
            ) from err
        raise OSError(f"Could not load the model {model!r}: {err}") from err


def looks_like_local_path(name: str) -> bool:
    """A path rather than a Hub id: starts with ./ ../ / or ~, or has more separators than owner/name's one."""
    starts = ("./", "../", "/", "~", "." + os.sep, ".." + os.sep, os.sep)
    return name.startswith(starts) or name.count("/") + (name.count(os.sep) if os.sep != "/" else 0) > 1


def check_local_model_path(model: str) -> None:
    """A model named by a local path must be a directory there: otherwise transformers asks the Hub and answers about
    repo ids, which hides a typo in the path."""
    if not looks_like_local_path(model) or os.path.isdir(os.path.expanduser(model)):
        return
    offline = " (HF_HUB_OFFLINE is set, so the Hub is not reachable either)" if hub_offline() else ""
    kind = "is a file, not a model directory" if os.path.exists(os.path.expanduser(model)) else "does not exist"
    raise OSError(
        f"The model path {model!r} looks like a local directory, but {os.path.abspath(os.path.expanduser(model))} "
        f"{kind}{offline}. Check the path (a relative one starts from the current directory, {os.getcwd()}): it "
        "must be a directory with config.json and the weights (save_pretrained's output); a Hub model is named "
        "owner/name."
    )


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def load_tokenizer(
    processing_class: Any, model: PreTrainedModel, trust_remote_code: bool, gguf_file: Optional[str] = None
) -> Any:
    """The processing class as given, or loaded from the model (a processor for vision-language models;
    from `gguf_file` when the model came from one), with its tokenizer set to pad on the left and to
    fall back to EOS for padding (TRL)."""
    if processing_class is None:
        auto = AutoProcessor if is_vision_language_config(model.config) else AutoTokenizer
        source = {gguf.GGUF_KEY: gguf_file} if gguf_file else {}
        processing_class = auto.from_pretrained(
            model.config._name_or_path, trust_remote_code=trust_remote_code, **source
        )
        check_tokenizer_loaded(text_tokenizer(processing_class), model.config._name_or_path)
    tokenizer = text_tokenizer(processing_class)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                "The tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token before training."
            )
        tokenizer.pad_token = tokenizer.eos_token  # as TRL: padding is masked out, so reusing EOS is safe
    return processing_class


def check_tokenizer_loaded(tokenizer: Any, source: str) -> None:
    """transformers 5 builds an empty tokenizer, without an error, from a directory without tokenizer files; every
    prompt would then tokenize to no tokens. Refused here, naming the cause."""
    try:
        ids = tokenizer("Hello world, 1+2=3", add_special_tokens=False)["input_ids"]
    except Exception:  # a tokenizer that cannot encode plain text at all is refused below the same way
        ids = []
    if ids:
        return
    raise ValueError(
        f"The tokenizer loaded from {source!r} is empty ({len(tokenizer)} token(s) in its vocabulary; it encodes "
        f"text to no tokens): {source!r} has no tokenizer files (tokenizer.json, tokenizer_config.json, ...). Add "
        "the model's tokenizer files to it (tokenizer.save_pretrained(that directory)), or pass the tokenizer: "
        "GRPOTrainer(..., processing_class=AutoTokenizer.from_pretrained(where the tokenizer is))."
    )


def eos_token_ids(tokenizer: Any, model: PreTrainedModel) -> list[int]:
    """EOS ids of the tokenizer and the model's generation config (TRL: the union)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    if not ids:
        raise ValueError(
            "Neither the tokenizer nor the model's generation_config defines an EOS token; completions could never end."
        )
    return sorted(ids)


def enable_checkpointing(model: PreTrainedModel, kwargs: dict) -> None:
    # transformers >= 5.x renamed gradient checkpointing to activation checkpointing.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def recomputes_layers(model: torch.nn.Module) -> bool:
    """Whether `model`'s layers are recomputed in backward: checkpointing enabled, and training mode (transformers
    checkpoints only there). A peft wrapper is looked through to the transformers model."""
    base = model.get_base_model() if is_peft_model(model) else model
    # the same rename as above; the old property still answers but warns
    name = (
        "is_activation_checkpointing"
        if hasattr(type(base), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return base.training and bool(getattr(base, name, False))


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _fp32_head_forward(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return type(self).forward(self, hidden.float())


def runs_head_in_fp32(head: torch.nn.Module) -> bool:
    """Whether `head` was converted by `cast_lm_head_to_fp32` (it computes in fp32 outside autocast)."""
    forward = vars(head).get("forward")
    return getattr(forward, "__func__", None) is _fp32_head_forward


def _back_to_dtype(dtype: torch.dtype):
    def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    return hook


def cast_lm_head_to_fp32(model: PreTrainedModel) -> None:
    """Keep the LM head's weight in fp32 and run it in fp32, outside autocast (ScaleRL).

    With tied embeddings the input embedding shares that weight; its output is cast back to the
    model's dtype so the rest of the network runs as before. The patched forward is a method bound
    to the head, so a deep copy of the model (the reference) binds its own head.

    Unlike grouprl's other changes (patches.py) this one is not undone after train(): it is a
    conversion the user asked for at construction, as in TRL, and the fp32 weight needs its fp32
    forward for the model to run at all outside training (an fp32 head on bf16 hidden states fails).
    """
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("cast_lm_head_to_fp32=True but the model has no output embedding (LM head).")
    dtype = next(model.parameters()).dtype
    embeddings = model.get_input_embeddings()
    tied = embeddings is not None and embeddings.weight is head.weight
    head.float()
    head.forward = types.MethodType(_fp32_head_forward, head)
    if tied and dtype != torch.float32:
        embeddings.register_forward_hook(_back_to_dtype(dtype))


def is_moe(model: PreTrainedModel) -> bool:
    return hasattr(model.config, "output_router_logits")


def router_aux_loss_coef(configured: Optional[float], model: PreTrainedModel) -> float:
    """TRL: None = the model config's router_aux_loss_coef (0 if absent); non-zero on a dense model is an error."""
    if configured is None:
        return float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0) if is_moe(model) else 0.0
    if configured != 0.0 and not is_moe(model):
        raise ValueError(
            f"GRPOConfig.router_aux_loss_coef={configured} but {type(model).__name__} is not a mixture-of-experts "
            "model (its config has no output_router_logits). Leave router_aux_loss_coef=None (or 0)."
        )
    return float(configured)
