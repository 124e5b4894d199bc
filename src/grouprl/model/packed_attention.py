"""Attention for prompt-packed sequences that only scores the pairs the mask allows.

A pack (prompt_packing.py) is [prompt, completion_1, ..., completion_k]; a completion token sees the
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

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.utils import logging

from grouprl.core.cpu_capabilities import bf16_emulation_reason
from grouprl.model.forward import product_dtype

logger = logging.get_logger("grouprl")

LAYOUT_KWARG = "grouprl_pack_layout"
SDPA_TAKES_GROUPED_HEADS = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (
    2,
    5,
)  # enable_gqa= since torch 2.5


class PackLayout(NamedTuple):
    """Where prompts and completions sit in a (rows, L) batch of packs; all index tensors on the model's device."""

    prompt_width: int  # P: the longest prompt
    prompt_index: torch.Tensor  # (prompts, P) flat (rows * L) position of each prompt's tokens (padding: its first)
    prompt_mask: torch.Tensor  # (prompts, 1, P, P) causal, key inside the prompt
    completion_index: (
        torch.Tensor
    )  # (N, C) flat (rows * L) position of each completion's tokens (padding: its prompt's first token)
    completion_prompt: torch.Tensor  # (N,) the prompt (pack) of each completion
    completion_mask: torch.Tensor  # (N, 1, C, P + C): its prompt, then its own tokens causally
    prompt_rows: torch.Tensor  # indices into (prompts * P) of real prompt positions ...
    completion_rows: torch.Tensor  # ... and into (N * C) of real completion positions ...
    targets: torch.Tensor  # ... and where, in (rows * L), their outputs go (prompt rows first)
    # Attend by explicit products (`grouped_attention`) instead of sdpa's kernel: set where the scores it keeps for
    # backward live only briefly (layers recomputed by gradient checkpointing, or no gradient at all).
    explicit_scores: bool = False


def build_layout(
    prompt_starts: list[int], prompt_lens: list[int], spans: list[list[tuple[int, int]]], device: torch.device
) -> PackLayout:
    """Pack b's prompt is the `prompt_lens[b]` tokens from flat position `prompt_starts[b]`; `spans[b]` lists
    (flat start, tokens) of each of its completions."""
    width = max(prompt_lens)
    longest = max((t for pack in spans for _, t in pack), default=1) or 1
    prompt_index, prompt_rows, prompt_targets = [], [], []
    index, owner, own_lens, completion_rows, completion_targets = [], [], [], [], []
    for b, (first, p, pack) in enumerate(zip(prompt_starts, prompt_lens, spans)):
        prompt_index.append([first + i if i < p else first for i in range(width)])
        prompt_rows += range(b * width, b * width + p)
        prompt_targets += range(first, first + p)
        for start, t in pack:
            n = len(index)
            index.append([start + i if i < t else first for i in range(longest)])
            owner.append(b)
            own_lens.append(t)
            completion_rows += range(n * longest, n * longest + t)
            completion_targets += range(start, start + t)

    def longs(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    # the masks made on the model's device, as prompt_packing.build_pack's (L, L) one
    lens, own, keys = longs(prompt_lens), longs(own_lens), torch.arange(width, device=device)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    prompt_mask = causal & (keys < lens[:, None, None])  # (prompts, P, P)
    owner = longs(owner)
    prefix_visible = keys < lens[owner][:, None]  # (N, P)
    own_visible = torch.ones(longest, longest, dtype=torch.bool, device=device).tril() & (
        torch.arange(longest, device=device) < own[:, None, None]
    )  # (N, C, C)
    completion_mask = torch.cat([prefix_visible[:, None, :].expand(-1, longest, -1), own_visible], dim=2)
    return PackLayout(
        width,
        longs(prompt_index),
        prompt_mask[:, None],
        longs(index),
        owner,
        completion_mask[:, None],
        longs(prompt_rows),
        longs(completion_rows),
        longs(prompt_targets + completion_targets),
    )


def packed_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs
):
    """query (rows, H, L, D), key/value (rows, KVH, L, D) -> (rows, L, H, D), attending only the visible pairs."""
    layout: PackLayout = kwargs.pop(LAYOUT_KWARG)
    if sliding_window is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("packed attention serves full-attention layers without soft-capping or sinks only")
    rows, heads, length, d = query.shape
    groups = heads // key.shape[1]  # grouped-query attention: each key/value head serves `groups` query heads
    explicit = layout.explicit_scores and dropout == 0.0 and _explicit_products_pay_off(query)
    # The explicit products and the CPU kernels take grouped key/value heads directly (enable_gqa): no copy of K/V
    # per query head, and 1 / groups of the keys and values gathered below (W2's forward + backward attention
    # 284 -> 198 ms per layer on the CPU; on a GPU, Qwen2.5's 14 / 2 heads gathered 7x the bytes). CUDA's fused
    # kernels fall back to the math kernel for a masked grouped call, so there sdpa gets repeated heads.
    grouped = groups > 1 and (explicit or (query.device.type == "cpu" and SDPA_TAKES_GROUPED_HEADS))
    if not grouped:  # (repeat_kv returns the tensors as they are when groups == 1)
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    attend = dict(dropout_p=dropout, scale=scaling, **({"enable_gqa": True} if grouped else {}))
    if explicit:
        scale = scaling if scaling is not None else d**-0.5
        attend_masked = lambda q, k, v, attn_mask: grouped_attention(q, k, v, attn_mask, scale)  # noqa: E731
    else:
        attend_masked = lambda q, k, v, attn_mask: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=attn_mask, **attend
        )
    # One (rows * L, H + 2 KVH, D) table of the queries, keys and values, gathered by index into the prompts' and
    # the completions' batches: on a GPU each operator is a kernel launch, and a pass makes these per layer and pack
    # row, so one cat and two gathers stand in for three transposed copies and six gathers (and their backward).
    kv = key.shape[1]
    table = torch.cat([query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)], dim=2)
    table = table.view(rows * length, heads + 2 * kv, d)
    # (n, width, H + 2 KVH, D) -> its queries and its keys + values; split, not sliced: a slice's backward writes a
    # zero-filled gradient of the whole table, split's backward one cat
    prompt_q, prompt_kv = table[layout.prompt_index].split([heads, 2 * kv], dim=2)
    completion_q, completion_kv = table[layout.completion_index].split([heads, 2 * kv], dim=2)
    own_kv = torch.cat([prompt_kv[layout.completion_prompt], completion_kv], dim=1)  # its prompt's, then its own

    def heads_first(*parts: torch.Tensor) -> list[torch.Tensor]:  # (n, width, heads, D) -> (n, heads, width, D)
        return [x.transpose(1, 2) for x in parts]

    prompt_out = attend_masked(*heads_first(prompt_q, *prompt_kv.split(kv, dim=2)), attn_mask=layout.prompt_mask)
    completion_out = attend_masked(
        *heads_first(completion_q, *own_kv.split(kv, dim=2)), attn_mask=layout.completion_mask
    )
    out_rows = torch.cat(
        [
            prompt_out.transpose(1, 2).reshape(-1, heads, d)[layout.prompt_rows],
            completion_out.transpose(1, 2).reshape(-1, heads, d)[layout.completion_rows],
        ]
    )
    out = out_rows.new_zeros(rows * length, heads, d).index_put((layout.targets,), out_rows)  # padding positions: 0
    return out.view(rows, length, heads, d), None


def _explicit_products_pay_off(query: torch.Tensor) -> bool:
    """Whether the explicit products pay off: on a CPU whose matrix products on `query` run in bf16/fp16 (its dtype,
    or autocast's) at native speed. In fp32 sdpa's kernel was as fast or faster (SmolLM2's pack: 77-81 against
    88-95 ms forward + backward). A CPU that emulates bf16 (core/cpu_capabilities.py) keeps sdpa's kernel: its
    products were 3.7x slower than sdpa's there (bf16, 8 x 9/3 heads x 128 queries x 181 keys, forward + backward,
    oneDNN held to AVX2: 209 against 56 ms). On a GPU sdpa's kernel was faster and lighter (an H200, the 0.5B
    shape's training pass packed in rows of 8,192 tokens, bench_train_ops.py: 0.94 against 1.11 s with 48-token
    prompts, 1.13 against 1.17 s and 3.7 against 4.6 GB with a 1,024-token shared prompt)."""
    if query.device.type != "cpu" or product_dtype(query) not in (torch.bfloat16, torch.float16):
        return False
    return _cpu_runs_half_products_natively()


@functools.cache
def _cpu_runs_half_products_natively() -> bool:
    reason = bf16_emulation_reason()
    if reason is not None:
        logger.info(f"grouprl: packed attention runs sdpa's kernel, not explicit bf16 products: {reason}.")
    return reason is None


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(query key^T * scale, masked) value by two batched products, the softmax in fp32.

    query (n, H, Q, D); key/value (n, KVH, S, D) with H a multiple of KVH (query head h reads key/value head
    h // (H / KVH), as repeat_kv); mask (n, 1, Q, S) bool, True = visible, at least one key per query. The query
    heads sharing a key/value head become one (groups * Q)-row product: no copy of keys or values per head.
    On the CPU, for a pack's short completions (Q = 128 queries, S = 181 keys, 64 channels), forward and backward
    took 26 ms where sdpa's fused kernel took 70 ms (bf16, SmolLM2's 9/3 heads): the fused kernel works through
    the masked half of every block, and its backward recomputes the scores; this keeps the fp32 probabilities
    (n x H x Q x S) for backward instead, which is why it serves only layers recomputed or run without gradient.
    """
    n, heads, q_len, d = query.shape
    kv_heads, s_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # scaled on the queries (Q x D a head, the scores Q x S) and masked by a select: two passes fewer over the scores
    query = (query * scale).reshape(n, kv_heads, groups * q_len, d)
    scores = torch.matmul(query, key.transpose(-1, -2)).view(n, kv_heads, groups, q_len, s_len)
    scores = torch.where(mask[:, :, None], scores, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype).view(n, kv_heads, groups * q_len, s_len)
    return torch.matmul(probs, value).view(n, heads, q_len, d)


def sdpa_or_packed(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' sdpa attention, or packed_attention when the call carries a pack layout."""
    if kwargs.get(LAYOUT_KWARG) is not None:
        return packed_attention(module, query, key, value, attention_mask, *args, **kwargs)
    kwargs.pop(LAYOUT_KWARG, None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
