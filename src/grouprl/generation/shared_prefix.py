"""Decode attention that reads each prompt's KV cache once for all G samples of its group, and whether a
model may use it.

GRPO decodes G samples of every prompt at once. With a regular KV cache each sample holds its own
copy of the prompt's keys and values, and every decode step reads (and, with a growing cache,
copies) R = B * G copies of them: on a CPU that memory traffic, not the matmuls, is most of a step
(W2's ~400-token shared prompt). Here the cache keeps

- the prompt part once per prompt: (B, kv_heads, P, head_dim), with its padding mask (B, P);
- the sampled part per row, in a buffer allocated once for all new tokens: (R, kv_heads, N, head_dim),

and attention over the two parts is one softmax: scores against the prompt part are computed per
prompt for all its rows' queries together (a batched matmul over B, rows of a prompt gathered into
G slots), scores against the row's own tokens per row, then one softmax over both. Rows that finish
leave the buffer (`batch_select_indices`); their slot in the per-prompt grid simply stays empty.

The attention function is registered in transformers' attention registry only while
`patches.grouprl_patches()` is active, and a model uses it only inside `decoding`, which sets the
model's attention implementation through `model.set_attn_implementation` and sets the previous one
back on exit.

Whether a model may use it is checked once per model, the verdict logged once (`matches_standard_attention`).
The probe decodes two left-padded prompts, 2 samples each, for 3 steps, with the shared-prefix cache and
with a regular cache, and compares the logits. What counts as equal depends on the model's own rounding
noise, which the probe measures as well: the same regular decode with transformers' eager attention
instead of the model's own. In fp32 the two agree to ~3e-5 of the logits' scale, in bf16 only to ~10%
(SmolLM2-135M, logits of scale 30: bf16 sdpa, bf16 eager and the bf16 shared-prefix cache are each 1 to 6
away from the fp32 logits), so a fixed tolerance either rejects every bf16 model or accepts a wrong
attention in fp32. Architectures whose attention layers do something the shared
cache does not (sliding windows, sinks, soft-capping) fail the check and keep the regular cache; an error
other than "this model cannot run it" propagates.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache
from transformers.utils import logging

from grouprl.generation.kv_buffers import compact_rows
from grouprl.model.forward import cache_keyword, describe, is_unsupported
from grouprl.model.logprobs import position_ids_from_mask
from grouprl.model.patches import grouprl_patches, scoped_attention

logger = logging.get_logger("grouprl")

NAME = "grouprl_shared_prefix"
_ACTIVE: contextvars.ContextVar[SharedPrefixCache | None] = contextvars.ContextVar(
    "grouprl_shared_prefix_cache", default=None
)

_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()

SAMPLES = 2


class SharedPrefixCache:
    """Prompt keys/values once per prompt, sampled-token keys/values per row (see the module doc)."""

    is_compileable = False

    def __init__(self, prefill: DynamicCache, prompt_mask: torch.Tensor, samples_per_prompt: int, max_new_tokens: int):
        self.prefix_keys = [layer.keys for layer in prefill.layers]  # each (B, KVH, P, D)
        self.prefix_values = [layer.values for layer in prefill.layers]
        self.prefix_mask = prompt_mask.bool()  # (B, P)
        dtype = self.prefix_keys[0].dtype
        # Left padding of the prompts as an additive score bias (None when no prompt is padded).
        self.prefix_bias = (
            None
            if bool(self.prefix_mask.all())
            else torch.zeros(self.prefix_mask.shape, dtype=dtype, device=prompt_mask.device).masked_fill(
                ~self.prefix_mask, float("-inf")
            )[:, None, None, :]
        )
        prompts, g = prompt_mask.shape[0], samples_per_prompt
        device = prompt_mask.device
        self.row_prompt = torch.arange(prompts, device=device).repeat_interleave(g)  # (R,) prompt of each row
        self.row_slot = torch.arange(prompts * g, device=device) % g  # (R,) its place among the prompt's rows
        self.slots = g
        kvh, d = self.prefix_keys[0].shape[1], self.prefix_keys[0].shape[3]
        self.keys = [
            torch.empty(prompts * g, kvh, max_new_tokens, d, dtype=dtype, device=device) for _ in self.prefix_keys
        ]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.lengths = [0] * len(self.keys)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store one new token per row (key_states: (R, KVH, 1, D)); attention reads the buffers itself."""
        t = self.lengths[layer_idx]
        self.keys[layer_idx][:, :, t] = key_states[:, :, 0]
        self.values[layer_idx][:, :, t] = value_states[:, :, 0]
        self.lengths[layer_idx] = t + 1
        return key_states, value_states

    def write(self, key_values: torch.Tensor, layer_idx: int) -> None:
        """FusedDecoder's step: (R, 2 * KVH, 1, D), the keys then the values of one new token per row."""
        heads = key_values.shape[1] // 2
        self.update(key_values[:, :heads], key_values[:, heads:], layer_idx)

    def layer(self, index: int) -> "SharedPrefixLayer":
        """Layer `index`'s part, as FusedDecoder's layer step takes a cache (`write`, `attend`)."""
        return SharedPrefixLayer(self, index)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The keys' dtype, which FusedDecoder writes a step's keys and queries in (attention runs in fp32 at least).
        Not `dtype`: accelerate's fp32 conversion of a model's outputs casts whatever has a bf16 `dtype`."""
        return self.keys[0].dtype

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefix_mask.shape[1] + self.lengths[layer_idx]

    @property
    def full(self) -> bool:
        """No row has left yet (rows only ever leave): row r is slot r % G of prompt r // G."""
        return len(self.row_prompt) == self.prefix_mask.shape[0] * self.slots

    def batch_select_indices(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (indices into the current rows); the name of transformers' Cache method."""
        self.row_prompt, self.row_slot = self.row_prompt[keep], self.row_slot[keep]
        self.keys = [compact_rows(k, keep, t) for k, t in zip(self.keys, self.lengths)]
        self.values = [compact_rows(v, keep, t) for v, t in zip(self.values, self.lengths)]

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query (R, H, 1, D) -> attention output (R, 1, H, D) over the row's prompt and its own tokens."""
        rows, heads, _, d = query.shape
        # Scores, softmax and sums in fp32 at least, as the fused attention kernels keep them: a bf16 score of
        # 30 is off by 0.1, which moves a softmax weight by 10% (SmolLM2-135M's bf16 logits were off by 7).
        work = torch.promote_types(query.dtype, torch.float32)
        prefix_k, prefix_v = self.prefix_keys[layer_idx].to(work), self.prefix_values[layer_idx].to(work)
        kvh, p, t = prefix_k.shape[1], prefix_k.shape[2], self.lengths[layer_idx]
        q = (query.to(work) * scaling).reshape(rows, kvh, heads // kvh, d)
        # Against the prompt: all rows of a prompt in one matmul with that prompt's keys.
        prefix_scores = torch.matmul(self._to_grid(q), prefix_k.transpose(-1, -2))  # (B, KVH, G*rep, P)
        if self.prefix_bias is not None:
            prefix_scores = prefix_scores + self.prefix_bias
        # Against the row's own sampled tokens, then one softmax over both parts.
        own_k, own_v = self.keys[layer_idx][:, :, :t].to(work), self.values[layer_idx][:, :, :t].to(work)
        scores = torch.cat(
            [self._from_grid(prefix_scores), torch.matmul(q, own_k.transpose(-1, -2))], dim=-1
        )  # (R, KVH, rep, P + t)
        weights = scores.softmax(dim=-1)
        out = self._from_grid(torch.matmul(self._to_grid(weights[..., :p]), prefix_v)) + torch.matmul(
            weights[..., p:], own_v
        )
        return out.reshape(rows, 1, heads, d).to(query.dtype)

    def _to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """(R, KVH, rep, m) per row -> (B, KVH, G * rep, m) per prompt (empty slots of finished rows are zero)."""
        rows, kvh, rep, m = x.shape
        prompts = self.prefix_mask.shape[0]
        if self.full:  # rows are still prompt-major and complete: a view
            grid = x.view(prompts, self.slots, kvh, rep, m)
        else:
            grid = x.new_zeros(prompts, self.slots, kvh, rep, m)
            grid[self.row_prompt, self.row_slot] = x
        return grid.permute(0, 2, 1, 3, 4).reshape(prompts, kvh, self.slots * rep, m)

    def _from_grid(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of `_to_grid`: (B, KVH, G * rep, m) -> (R, KVH, rep, m) for the current rows."""
        prompts, kvh, _, m = y.shape
        per_slot = y.view(prompts, kvh, self.slots, -1, m).permute(0, 2, 1, 3, 4)
        if self.full:
            return per_slot.reshape(prompts * self.slots, kvh, -1, m)
        return per_slot[self.row_prompt, self.row_slot]


class SharedPrefixLayer:
    """One layer of a SharedPrefixCache, with StaticLayerCache's interface."""

    def __init__(self, cache: SharedPrefixCache, index: int):
        self.cache, self.index, self.kv_dtype = cache, index, cache.kv_dtype

    def write(self, key_values: torch.Tensor) -> None:
        self.cache.write(key_values, self.index)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return self.cache.attend(self.index, query, scaling)


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
    cache = _ACTIVE.get()
    unserved = [
        what
        for what, present in (
            ("a call outside `decoding`", cache is None),
            ("a multi-token step", query.shape[2] != 1),
            ("sliding-window layers", sliding_window is not None),
            ("soft-capping", kwargs.get("softcap") is not None),
            ("attention sinks", kwargs.get("s_aux") is not None),
        )
        if present
    ]
    if unserved:
        raise NotImplementedError(
            f"shared-prefix attention serves single-token decode steps of full-attention layers only, "
            f"not {', '.join(unserved)}"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return cache.attend(module.layer_idx, query, scale), None


scoped_attention(NAME, shared_prefix_attention)  # a declaration: installed only inside grouprl_patches()


@contextlib.contextmanager
def decoding(model: torch.nn.Module, cache: SharedPrefixCache) -> Iterator[None]:
    """Within the block, `model`'s attention layers use `cache` through shared_prefix_attention."""
    with grouprl_patches():
        token = _ACTIVE.set(cache)
        try:
            with attention_implementation(model, NAME):
                yield
        finally:
            _ACTIVE.reset(token)


def matches_standard_attention(model: torch.nn.Module) -> bool:
    """Whether decoding with SharedPrefixCache reproduces the model's own attention (checked once per model)."""
    if model not in _VERIFIED:
        reason = probe(model)
        _VERIFIED[model] = reason is None
        name = type(model).__name__
        if reason is None:
            logger.info(
                f"grouprl: shared-prefix decoding is on for {name}: each prompt's KV cache is read once for its "
                "samples."
            )
        else:
            logger.log(
                logging.WARNING if reason.startswith("the probe") else logging.INFO,
                f"grouprl: shared-prefix decoding is off for {name}: {reason}. Each sample keeps its own copy of the "
                "prompt's cache.",
            )
    return _VERIFIED[model]


def logit_tolerance(expected: torch.Tensor, noise: float) -> float:
    """How far the shared-prefix logits may be from a regular cache's: twice the model's own noise (eager vs
    its attention), and at least 1e-3 of the logits' scale, since the two attentions sum in another order (a
    tolerance per element, as allclose, flagged fp32 SmolLM2-135M's 4.6e-4 on near-zero logits)."""
    return 1e-4 + max(2.0 * noise, 1e-3 * float(expected.abs().max()))


@torch.no_grad()
def probe(model: torch.nn.Module) -> str | None:
    """None if the shared-prefix cache decodes as a regular one, within the model's own noise; else why not."""
    if not callable(getattr(model, "set_attn_implementation", None)):
        return f"{type(model).__name__} has no set_attn_implementation"
    vocab = model.get_input_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    prompts = torch.tensor([[0, 3, 5, 7], [2, 4, 6, 8]], device=device) % vocab
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], device=device)
    steps = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], device=device) % vocab  # tokens fed per step
    try:
        expected = regular_decode(model, prompts, mask, steps)
        with attention_implementation(model, "eager"):
            eager = regular_decode(model, prompts, mask, steps)
        got = shared_decode(model, prompts, mask, steps)
    except Exception as err:
        if not is_unsupported(err):
            raise
        return f"the probe's decode step failed: {describe(err)}"
    # The noise of the whole probe: in bf16 it moves from step to step (SmolLM2-135M: 0.75 to 3.25).
    noise = max(float((other - want).abs().max()) for want, other in zip(expected, eager))
    for want, have in zip(expected, got):
        largest_gap, allowed = float((have - want).abs().max()), logit_tolerance(want, noise=noise)
        if largest_gap > allowed:
            return (
                f"the probe's decode logits differ from a regular cache's by up to {largest_gap:.3g} "
                f"(allowed: {allowed:.3g}, from the model's own eager-vs-{model.config._attn_implementation} noise)"
            )
    return None


def regular_decode(
    model: torch.nn.Module, prompts: torch.Tensor, mask: torch.Tensor, steps: torch.Tensor
) -> list[torch.Tensor]:
    """Each step's logits (fp32) with a regular cache holding every sample's copy of its prompt."""
    cache = DynamicCache(config=model.config)
    full_mask = mask.repeat_interleave(SAMPLES, 0)
    model(
        input_ids=prompts.repeat_interleave(SAMPLES, 0),
        attention_mask=full_mask,
        position_ids=position_ids_from_mask(full_mask),
        **{cache_keyword(model): cache},
        use_cache=True,
    )
    positions, logits = full_mask.sum(dim=1), []
    for step in steps:
        full_mask = torch.cat([full_mask, full_mask.new_ones(len(full_mask), 1)], dim=1)
        out = model(
            input_ids=step[:, None],
            position_ids=positions[:, None],
            attention_mask=full_mask,
            **{cache_keyword(model): cache},
            use_cache=True,
        )
        logits.append(out.logits.float())
        positions = positions + 1
    return logits


def shared_decode(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    mask: torch.Tensor,
    steps: torch.Tensor,
    forward: Callable[..., Any] | None = None,
) -> list[torch.Tensor]:
    """Each step's logits (fp32) with the shared-prefix cache: one prefill per prompt for its samples; the model
    runs as `forward` (default: `model` itself)."""
    forward = forward or model
    shared = shared_prefill(forward, model.config, prompts, mask, SAMPLES, steps.shape[0])
    positions, logits = mask.repeat_interleave(SAMPLES, 0).sum(dim=1), []
    for step in steps:
        with decoding(model, shared):
            out = forward(
                input_ids=step[:, None],
                position_ids=positions[:, None],
                **{cache_keyword(forward): shared},
                use_cache=True,
            )
        logits.append(out.logits.float())
        positions = positions + 1
    return logits


def shared_prefill(
    forward: Callable[..., Any], config: Any, prompts: torch.Tensor, mask: torch.Tensor, samples: int, new_tokens: int
) -> SharedPrefixCache:
    """`forward` (a model, or its class forward) prefills `prompts` once; their cache, shared by `samples` rows each."""
    prefill = DynamicCache(config=config)
    forward(
        input_ids=prompts,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        **{cache_keyword(forward): prefill},
        use_cache=True,
    )
    return SharedPrefixCache(prefill, mask, samples, new_tokens)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """`model` runs with transformers' attention `name` inside the block, its own one after; NotImplementedError if
    transformers declines the switch (it logs why): not this model."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        if model.config._attn_implementation != name:
            raise NotImplementedError(
                f"{type(model).__name__} cannot switch its attention implementation "
                f"(set_attn_implementation left it at {model.config._attn_implementation!r})"
            )
        yield
    finally:
        model.set_attn_implementation(previous)
