"""GGUF checkpoints (llama.cpp's single-file format) as a starting point for training.

transformers reads a GGUF file through ``from_pretrained(dir, gguf_file=NAME)``, with the ``gguf``
package, and marks the model as quantized by GGUF even when every weight was unpacked into an
ordinary dense tensor. Training needs those dense tensors (``dequantize=True``), and the mark makes
``save_pretrained`` refuse the model. Once the weights are dense the mark says nothing true, so it
is taken off: the model then saves as an ordinary transformers checkpoint, which ``from_pretrained``
loads without ``gguf_file`` (and without the ``gguf`` package).
"""

from __future__ import annotations

import importlib.util
from typing import Any

GGUF_KEY = "gguf_file"


def require_gguf_package(where: str) -> None:
    """A clear error when a GGUF file is asked for and the `gguf` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            f"{where} names a GGUF file, which transformers reads with the `gguf` package, and it is not installed. "
            "Install it with `pip install gguf` (or `pip install grouprl[gguf]`), or train from an ordinary "
            "transformers checkpoint directory instead."
        )


def dense_loading_kwargs(kwargs: dict) -> dict:
    """from_pretrained kwargs that unpack every GGUF weight into a dense tensor (what training needs).

    Without it, transformers keeps the weights in GGUF blocks when a GGUF matmul kernel is installed
    (`kernels`), and those blocks have no gradient.
    """
    from transformers import GgufConfig

    given = kwargs.get("quantization_config")
    if given is None:
        return {**kwargs, "quantization_config": GgufConfig(dequantize=True)}
    if isinstance(given, GgufConfig):
        if not given.dequantize:
            raise ValueError(
                "model_init_kwargs['quantization_config'] is a GgufConfig with dequantize=False: GGUF blocks "
                "cannot be trained. Leave quantization_config out (grouprl then unpacks the weights) or set "
                "dequantize=True."
            )
        return kwargs
    raise ValueError(
        f"model_init_kwargs names a gguf_file and a {type(given).__name__} quantization_config; transformers "
        "cannot quantize a GGUF checkpoint further. Leave quantization_config out, or convert the GGUF file to an "
        "ordinary checkpoint first (load it, then save_pretrained) and quantize that."
    )


def is_gguf_loaded(model: Any) -> bool:
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    return str(getattr(method, "value", method)) == "gguf"


def as_plain_model(model: Any) -> Any:
    """Take the GGUF mark off a GGUF-loaded model whose weights are all dense; other models are returned as they are.

    A model that still holds GGUF blocks (a module whose class name starts with ``Gguf``, transformers'
    packed linear layers) cannot be trained and is refused by name.
    """
    if not is_gguf_loaded(model):
        return model
    packed = sorted(
        {type(module).__name__ for module in model.modules() if type(module).__name__.lower().startswith("gguf")}
    )
    if packed:
        raise ValueError(
            f"The model was loaded from a GGUF file with its weights left in GGUF blocks ({', '.join(packed)}), which "
            "cannot be trained. Load it with quantization_config=GgufConfig(dequantize=True), or pass the directory as "
            "model= with GRPOConfig(model_init_kwargs={'gguf_file': NAME}) and grouprl unpacks it."
        )
    if any(not parameter.is_floating_point() for parameter in model.parameters()):
        raise ValueError(
            "The GGUF-loaded model has non-floating-point parameters (packed weights); load it dequantized."
        )
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model
