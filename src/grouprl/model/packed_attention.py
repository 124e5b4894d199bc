"""Attention for prompt-packed sequences that only scores the pairs the mask allows.

A pack (pack_building.py) is [prompt, completion_1, ..., completion_k]; a completion token sees the
prompt and, causally, its own completion. With a dense 4D mask the attention still scores every
(query, key) pair of the packed length L, most of them masked: for W2 (a 333-token prompt and 8
completions of 128 tokens, L = 1,357) 1.84M pairs per head and layer where 0.58M are visible. Here
the prompt attends to itself causally and each completion to [prompt, own tokens] as a batch of
its own, so the work is the visible pairs (padding to the longest completion of the pass aside).

How it is reached: the pack's layout travels as a keyword argument (`LAYOUT_KWARG`) through the
model's forward to each attention call, and `sdpa_or_packed` stands in transformers' attention
registry under "sdpa" while `patches.grouprl_patches()` is active (and only then): with the layout it
runs `packed_attention`, without it (every other call, in any model) it is transformers' sdpa
unchanged. Gradient checkpointing recomputes a layer with the same keyword arguments, so recomputation
takes the same path with no context to hold.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

LAYOUT_KWARG = "grouprl_pack_layout"
SDPA_TAKES_GROUPED_HEADS = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (
    2,
    5,
)  # enable_gqa= since torch 2.5


class PackLayout(NamedTuple):
    """Where prompts and completions sit in a (packs, L) batch of packs; all index tensors on the model's device."""

    prompt_width: int  # P: the longest prompt; prompts start every pack
    prompt_mask: torch.Tensor  # (packs, 1, P, P) causal, key inside the pack's prompt
    completion_index: (
        torch.Tensor
    )  # (N, C) flat (packs * L) position of each completion's tokens (padding: any valid one)
    completion_pack: torch.Tensor  # (N,) the pack of each completion
    completion_mask: torch.Tensor  # (N, 1, C, P + C): the pack's prompt, then its own tokens causally
    prompt_rows: torch.Tensor  # indices into (packs * P) of real prompt positions ...
    completion_rows: torch.Tensor  # ... and into (N * C) of real completion positions ...
    targets: torch.Tensor  # ... and where, in (packs * L), their outputs go (prompt rows first)


def build_layout(
    prompt_lens: list[int], spans: list[list[tuple[int, int]]], length: int, device: torch.device
) -> PackLayout:
    """`spans[b]` lists (start, tokens) of each completion of pack b; pack b's
    prompt is positions 0..prompt_lens[b]-1."""
    width = max(prompt_lens)
    longest = max((t for pack in spans for _, t in pack), default=1) or 1
    index, owner, own_lens, prompt_rows, completion_rows, prompt_targets, completion_targets = (
        [],
        [],
        [],
        [],
        [],
        [],
        [],
    )
    for b, (p, pack) in enumerate(zip(prompt_lens, spans)):
        prompt_rows += range(b * width, b * width + p)
        prompt_targets += range(b * length, b * length + p)
        for start, t in pack:
            n = len(index)
            index.append([b * length + start + i if i < t else b * length for i in range(longest)])
            owner.append(b)
            own_lens.append(t)
            completion_rows += range(n * longest, n * longest + t)
            completion_targets += range(b * length + start, b * length + start + t)
    lens = torch.tensor(prompt_lens)
    keys = torch.arange(width)
    prompt_mask = torch.ones(width, width, dtype=torch.bool).tril() & (keys < lens[:, None, None])  # (packs, P, P)
    own = torch.tensor(own_lens)
    prefix_visible = keys < lens[torch.tensor(owner)][:, None]  # (N, P)
    own_visible = torch.ones(longest, longest, dtype=torch.bool).tril() & (
        torch.arange(longest) < own[:, None, None]
    )  # (N, C, C)
    completion_mask = torch.cat([prefix_visible[:, None, :].expand(-1, longest, -1), own_visible], dim=2)

    def longs(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return PackLayout(
        width,
        prompt_mask[:, None].to(device),
        longs(index),
        longs(owner),
        completion_mask[:, None].to(device),
        longs(prompt_rows),
        longs(completion_rows),
        longs(prompt_targets + completion_targets),
    )


def packed_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs
):
    """query (packs, H, L, D), key/value (packs, KVH, L, D) -> (packs, L, H, D), attending only the visible pairs."""
    layout: PackLayout = kwargs.pop(LAYOUT_KWARG)
    if sliding_window is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("packed attention serves full-attention layers without soft-capping or sinks only")
    packs, heads, length, d = query.shape
    groups = heads // key.shape[1]  # grouped-query attention: each key/value head serves `groups` query heads
    # The CPU kernels take grouped key/value heads directly (enable_gqa): no copy of K/V per query head, half
    # the gathered prompt keys below (W2's forward + backward attention 284 -> 198 ms per layer). CUDA's fused
    # kernels fall back to the math kernel for a masked grouped call, so there the heads are repeated.
    grouped = groups > 1 and query.device.type == "cpu" and SDPA_TAKES_GROUPED_HEADS
    if not grouped:  # (repeat_kv returns the tensors as they are when groups == 1)
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    p = layout.prompt_width
    attend = dict(dropout_p=dropout, scale=scaling, **({"enable_gqa": True} if grouped else {}))
    prompt_out = F.scaled_dot_product_attention(
        query[:, :, :p], key[:, :, :p], value[:, :, :p], attn_mask=layout.prompt_mask, **attend
    )

    def completions(x: torch.Tensor) -> torch.Tensor:  # (packs, heads, L, D) -> (N, heads, C, D)
        return x.transpose(1, 2).reshape(packs * length, x.shape[1], d)[layout.completion_index].transpose(1, 2)

    own_keys = torch.cat([key[layout.completion_pack, :, :p], completions(key)], dim=2)
    own_values = torch.cat([value[layout.completion_pack, :, :p], completions(value)], dim=2)
    completion_out = F.scaled_dot_product_attention(
        completions(query), own_keys, own_values, attn_mask=layout.completion_mask, **attend
    )
    rows = torch.cat(
        [
            prompt_out.transpose(1, 2).reshape(-1, heads, d)[layout.prompt_rows],
            completion_out.transpose(1, 2).reshape(-1, heads, d)[layout.completion_rows],
        ]
    )
    out = rows.new_zeros(packs * length, heads, d).index_put((layout.targets,), rows)  # padding positions: 0
    return out.view(packs, length, heads, d), None


def sdpa_or_packed(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' sdpa attention, or packed_attention when the call carries a pack layout."""
    if kwargs.get(LAYOUT_KWARG) is not None:
        return packed_attention(module, query, key, value, attention_mask, *args, **kwargs)
    kwargs.pop(LAYOUT_KWARG, None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
