"""The captured loop's decode step as the model's own forward: one token a row through `model(...)` over the static
cache (static_kv_cache.py), its attention layers reading that cache through an attention function registered in
transformers' attention interface, as vLLM's and SGLang's Transformers backends do.

No family knowledge: whatever the model's forward computes around attention (norms, RoPE of any layout, gates,
multipliers, routed experts, soft-capped logits) is its own code. What this module adds:

- `static_cache_attention`, installed as `NAME` while a step runs: a layer's query against its keys and values in
  the static cache, over the columns its row has filled (a sliding-window layer's window only), with soft-capping and
  attention sinks as transformers' eager attention computes them. The model's mask builder has no entry for that
  name and builds no mask, so a step builds none either;
- `StaticCacheView`, the `cache` the forward is given: `update` writes a layer's keys and values at the cache's
  device-side column (no host sync, so the step can be captured), a linear-attention layer's convolution and
  recurrent states live in the cache's fixed buffers (transformers' state interface: get / update_conv_state,
  get / update_recurrent_state);
- `cast_once`: every plain `nn.Linear` multiplies by its weight cast to the step's dtype once per call (under bf16
  autocast the forward would cast every fp32 weight again at every step), packed for oneDNN where a CPU runs bf16
  products from packed weights, and in the weight-major orientation for few fp32 rows on a CPU (cpu_products.py).

What it cannot run it refuses with a reason (`model_step_reason`), and what it would compute differently the
probe finds (decode_probe.py): a layer whose keys and values differ in width (multi-head latent attention), a
window the model passes that the cache was not told of, a forward that reads the cache's length on the host.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F

from grouprl.generation.cpu_products import few_row_linear, pack_weight, packed_linear, packs_weights
from grouprl.generation.shared_prefix import attention_implementation
from grouprl.generation.static_kv_cache import StaticKVCache
from grouprl.model.forward import cache_keyword
from grouprl.model.layer_configs import FULL, LINEAR_ATTENTION, layer_kinds
from grouprl.model.patches import grouprl_patches, scoped_attention

NAME = "grouprl_static_decode"


def static_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    static_cache: Optional[StaticKVCache] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (rows, heads, 1, dim) -> (rows, 1, heads, dim), over the
    static cache of `module.layer_idx` (the key and value given are this step's, written there by the view). The
    cache comes as a keyword the forward passes down to its attention, as it passes its own (a graph input of a
    compiled step, where a context variable would be a constant)."""
    cache = static_cache
    if cache is None or query.shape[2] != 1:
        raise NotImplementedError("the static-cache attention serves single-token steps inside ModelStep.step only")
    index = module.layer_idx
    if (sliding_window or None) != cache.windows[index]:
        raise NotImplementedError(
            f"layer {index} attends over a window of {sliding_window}, the static cache was told {cache.windows[index]}"
        )
    layer = cache.layer(index)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if s_aux is not None or softcap is not None:
        return layer.attend_eager(query, scale, sinks=s_aux, softcap=softcap), None
    return layer.attend(query, scale), None


scoped_attention(NAME, static_cache_attention)  # a declaration: installed only inside grouprl_patches()


class StaticCacheView:
    """The `cache` a ModelStep's forward is given: transformers' Cache methods a decode step calls, over a
    StaticKVCache. Anything else the forward asks of a cache raises, and the probe refuses that model."""

    is_compileable = True

    def __init__(self, cache: StaticKVCache):
        self.cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if key_states.shape[-1] != value_states.shape[-1]:
            raise NotImplementedError("its keys and values differ in width (the static cache keeps them in one buffer)")
        layer = self.cache.layer(layer_idx)
        layer.write(torch.cat([key_states, value_states], dim=1).to(layer.kv_dtype))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError("its forward reads the cache's length on the host, which a captured step cannot")

    # a linear-attention layer's states (Qwen3.5's gated delta rule), in place
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.cache.states[layer_idx].conv_state

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.cache.states[layer_idx].recurrent_state

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = self.cache.states[layer_idx].recurrent_state
        target.copy_(state)
        return target

    def update_conv_state(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("its linear attention rebuilds its convolution state in a single-token step")

    def __getattr__(self, name: str) -> Any:
        raise UnkeptCacheAttribute(f"its forward asks the cache for {name!r}, which the static cache does not keep")


class UnkeptCacheAttribute(NotImplementedError, AttributeError):
    """A Cache attribute StaticCacheView does not keep: an AttributeError too, so that a forward's `hasattr(cache,
    ...)` reads it as absent (transformers' mask builders ask for `is_sliding` so), a NotImplementedError for the
    probe (a model that uses it is refused)."""


def model_step_reason(model: torch.nn.Module) -> Optional[str]:
    """None if ModelStep can run `model`'s decode steps (the probe decides whether they compute as its forward),
    else why not."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "set_attn_implementation"):
        return "not a transformers model"
    config = config.get_text_config()
    try:  # whether it takes a registered attention function (some keep 'eager' whatever is asked)
        with grouprl_patches(), attention_implementation(model, NAME):
            pass
    except (ValueError, NotImplementedError, KeyError) as err:
        return f"its attention cannot be switched to a registered function ({type(err).__name__}: {err})"
    kinds = set(layer_kinds(config)) - {FULL, "sliding_attention", "chunked_attention", LINEAR_ATTENTION}
    if kinds:
        return f"its layers of type {sorted(kinds)} are neither attention nor linear attention"
    return None


def windows(model: torch.nn.Module) -> list[Optional[int]]:
    """Each layer's sliding window as the model's attention passes it (None: a full or linear-attention layer)."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    return [None if kind in (FULL, LINEAR_ATTENTION) else window for kind in layer_kinds(config)]


class ModelStep:
    """`step(tokens, positions, cache) -> fp32 logits`: one decode step through `model`'s own forward (module doc).
    Used within `active(cache, longest)`, which registers the attention and casts the weights once."""

    def __init__(self, model: torch.nn.Module, pack: bool = True):
        self.model = model
        device = model.get_input_embeddings().weight.device
        self.device_type = device.type
        autocast = torch.is_autocast_enabled(device.type)
        self.dtype = torch.get_autocast_dtype(device.type) if autocast else model.get_input_embeddings().weight.dtype
        self.pack = pack
        self.windows = windows(model)
        self.keyword = cache_keyword(model)
        self.forward = type(self)._forward  # static_decode may put a compiled one here

    @contextlib.contextmanager
    def active(self, longest: int) -> Iterator[None]:
        """The block a call's steps run in, its weights cast once for all of them; `longest`: the longest sequence
        they reach (unused here: the model's forward computes RoPE itself)."""
        model = self.model
        with grouprl_patches(), cast_once(model, self.dtype, self.pack), attention_implementation(model, NAME):
            yield

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """tokens, positions: (rows,) -> (rows, vocab) fp32 logits; writes the step's keys and values into `cache`."""
        return self.forward(self, tokens, positions, StaticCacheView(cache))

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, view: StaticCacheView) -> torch.Tensor:
        out = self.model(
            input_ids=tokens[:, None],
            position_ids=positions[:, None],
            use_cache=True,
            logits_to_keep=1,
            static_cache=view.cache,
            **{self.keyword: view},
        )
        return out.logits[:, -1].float()


@contextlib.contextmanager
def cast_once(model: torch.nn.Module, dtype: torch.dtype, pack: bool = True) -> Iterator[None]:
    """Within the block, every plain `nn.Linear` of `model` multiplies by its weight in `dtype`, cast once here
    (module doc); subclasses (quantized layers) and layers whose forward is replaced already keep theirs."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)]
    for layer in layers:
        product = _PRODUCTS.setdefault(layer, CastProduct())
        product.load(layer, dtype, pack)
        layer.forward = product
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
            _PRODUCTS[layer].release()


class CastProduct:
    """A layer's product with its weight cast once (`cast_once`). One object per layer for the process's life, its
    tensors replaced each call: a compiled step guards on the identity of the functions it calls, so a new one
    each call would compile the step again."""

    def __init__(self) -> None:
        self.weight: Optional[torch.Tensor] = None
        self.bias: Optional[torch.Tensor] = None
        self.kind = "linear"  # 'linear' (F.linear), 'few_rows' (fp32 on a CPU: weight-major), 'packed' (oneDNN bf16)
        self.dtype = torch.float32

    def load(self, layer: torch.nn.Linear, dtype: torch.dtype, pack: bool) -> None:
        weight, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
        self.dtype, self.kind = dtype, "linear"
        if weight.dtype == dtype == torch.float32 and weight.device.type == "cpu":
            self.kind = "few_rows"
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        if pack and packs_weights(dtype, weight.device):
            self.kind, weight = "packed", pack_weight(weight)
        self.weight, self.bias = weight, bias

    def release(self) -> None:
        self.weight = self.bias = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "few_rows":
            return few_row_linear(x, self.weight, self.bias)
        if self.kind == "packed":
            flat = x.reshape(-1, x.shape[-1]).to(self.dtype)
            return packed_linear(flat, self.weight, self.bias).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)


_PRODUCTS: weakref.WeakKeyDictionary[torch.nn.Module, CastProduct] = weakref.WeakKeyDictionary()
