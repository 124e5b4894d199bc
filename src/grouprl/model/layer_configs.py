"""The configuration each decoder layer is built from.

Since transformers 5.2x a config may give some layers values of their own (`per_layer_config`: Gemma 4's
full-attention layers have a head_dim of 512 where its sliding ones have 256). Reading such a value from the config
itself raises `AmbiguousGlobalPerLayerAttributeError` (a RuntimeError, so `getattr`'s default does not catch it):
code that sizes layers reads it per layer here."""

from __future__ import annotations

from typing import Any


def is_heterogeneous(config: Any) -> bool:
    """Whether some of the model's layers take values of their own (`per_layer_config`)."""
    return bool(getattr(config, "is_heterogeneous", False))


def layer_configs(config: Any) -> list[Any]:
    """One config a decoder layer: transformers' per-layer views where layers differ, else `config` for each."""
    if is_heterogeneous(config):
        return list(config.per_layer_config)
    return [config] * config.num_hidden_layers


FULL = "full_attention"  # a layer type without a window
LINEAR_ATTENTION = "linear_attention"  # a layer type whose mixer is a recurrence (Qwen3.5's gated delta rule)


def layer_kinds(config: Any) -> list[str]:
    """Each layer's attention type: config.layer_types, or, for a config that names none, a sliding window in every
    layer where config.sliding_window is set (Mistral)."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    return [FULL if not getattr(config, "sliding_window", None) else "sliding_attention"] * config.num_hidden_layers
