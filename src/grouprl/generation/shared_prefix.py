"""Decode attention that reads each prompt's KV cache once for all G samples of its group.

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
back on exit. Whether a model may use it is checked once per model (shared_prefix_probe.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from grouprl.generation.kv_buffers import compact_rows
from grouprl.model.patches import grouprl_patches, scoped_attention

NAME = "grouprl_shared_prefix"
_ACTIVE: contextvars.ContextVar[SharedPrefixCache | None] = contextvars.ContextVar(
    "grouprl_shared_prefix_cache", default=None
)


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
    previous = model.config._attn_implementation
    with grouprl_patches():
        token = _ACTIVE.set(cache)
        try:
            model.set_attn_implementation(NAME)
            try:
                if model.config._attn_implementation != NAME:  # transformers declined (it logs why): not this model
                    raise NotImplementedError(
                        f"{type(model).__name__} cannot switch its attention implementation "
                        f"(set_attn_implementation left it at {model.config._attn_implementation!r})"
                    )
                yield
            finally:
                model.set_attn_implementation(previous)
        finally:
            _ACTIVE.reset(token)
