"""The static decode loop's KV cache (static_decode.py): every layer's keys and values in buffers allocated once
per generate call, written at a column the decode step advances on the device, with a mask of the real columns; a
linear-attention layer's states (Qwen3.5's gated delta rule: its convolution's last inputs, its recurrent matrix) in
buffers updated in place. Nothing in it changes shape or address from step to step, so a step that uses it can be
captured as a CUDA graph.

The columns are allocated in a multiple of `COLUMN_MULTIPLE` (the extra ones never valid): CUDA's memory-efficient
attention kernel pads a score bias whose rows are not 16-aligned, which would be a copy in every layer of every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

COLUMN_MULTIPLE = 16
STATE_NAMES = ("conv_states", "recurrent_states")  # transformers' LinearAttentionLayer's, each {0: tensor}


class StaticKVCache:
    """Every layer's keys and values, (rows, kv_heads, columns, head_dim), allocated once; the FusedDecoder cache
    interface over them (`layer`: a layer's `write` and `attend`).

    `kv_dtype`: the attention's, which the training forward computes in (under autocast, its dtype: the prefill's
    keys come in fp32 there, since RoPE runs in the residual stream's dtype, and are rounded here as autocast rounds
    them before sdpa). `column` (a 1-element device tensor) is where the next token's keys and values go; `valid`
    (rows, columns) marks the prompt's real tokens and every token decoded so far, and `bias` (rows, 1, 1, columns)
    is the same as the scores' additive bias in `kv_dtype` (0 or -inf), kept once for every layer: given a boolean
    mask, sdpa would convert it in each layer.

    Sliding-window layers (`windows`, one a layer) see the keys of their window only: a key `window` columns or more
    before the query's is masked too, in a bias kept once for each window. Every row's columns are its positions
    shifted by its left padding, so a column distance is a position distance. Their prefill may keep only the
    window's last tokens (transformers' sliding-window cache layers), right-aligned here.

    A linear-attention layer of the prefill (transformers' `LinearAttentionLayer`: `conv_states`, `recurrent_states`)
    becomes a `StaticStateLayer`: its convolution's state (the products' outputs, exact) and its recurrent state in
    fp32, where the step computes with them, as transformers does. Left padding leaves both as without it:
    transformers zeroes the padded positions' inputs, which leave a zero state zero.
    """

    def __init__(
        self,
        prefill: DynamicCache,
        prompt_mask: torch.Tensor,
        prompt_of_row: torch.Tensor,
        new_tokens: int,
        kv_dtype: torch.dtype,
        windows: Sequence[int | None] = (),
    ):
        """`prompt_of_row` (rows,): the prefill's prompt each row continues (`repeated`: each prompt's samples)."""
        rows, prompt_length = len(prompt_of_row), prompt_mask.shape[1]
        columns = column_count(prompt_length, new_tokens)
        self.kv_dtype, device = kv_dtype, prompt_mask.device
        # a layer's keys and values in one buffer, so a step writes both at once (a kernel a layer fewer)
        self.key_values: list[torch.Tensor | None] = []
        self.states: dict[int, StaticStateLayer] = {}
        for index, source in enumerate(prefill.layers):
            if hasattr(source, "recurrent_states"):  # a linear-attention layer's
                conv, recurrent = (getattr(source, n)[0].index_select(0, prompt_of_row) for n in STATE_NAMES)
                self.states[index] = StaticStateLayer(conv.float(), recurrent.float(), kv_dtype)
                self.key_values.append(None)
                continue
            _, kv_heads, length, head_dim = source.keys.shape
            both = torch.zeros(rows, 2 * kv_heads, columns, head_dim, dtype=kv_dtype, device=device)
            start = prompt_length - length
            both[:, :kv_heads, start:prompt_length] = source.keys.index_select(0, prompt_of_row)
            both[:, kv_heads:, start:prompt_length] = source.values.index_select(0, prompt_of_row)
            self.key_values.append(both)
        self.valid = torch.zeros(rows, columns, dtype=torch.bool, device=device)
        self.valid[:, :prompt_length] = prompt_mask.bool().index_select(0, prompt_of_row)
        self.column = torch.full((1,), prompt_length, dtype=torch.long, device=device)
        self.bias = torch.zeros(rows, 1, 1, columns, dtype=kv_dtype, device=device).masked_fill_(
            ~self.valid[:, None, None, :], float("-inf")
        )
        self.windows = list(windows) or [None] * len(prefill.layers)
        self.column_numbers = torch.arange(columns, device=device)
        self.window_biases = {window: self.bias.clone() for window in set(self.windows) - {None}}

    def open_column(self) -> None:
        """Mark column `column` valid in every row: the token a step feeds is attended from that step on; a
        sliding window's bias drops the column that left it."""
        self.valid.index_fill_(1, self.column, True)
        self.bias.index_fill_(3, self.column, 0.0)
        for window, bias in self.window_biases.items():
            bias.copy_(self.bias.masked_fill(self.column_numbers <= self.column - window, float("-inf")))

    def layer(self, index: int) -> "StaticLayerCache | StaticStateLayer":
        """Layer `index`'s buffer, with what a decode step's layer does with it (`write`, `attend`); a linear-attention
        layer's states."""
        if index in self.states:
            return self.states[index]
        bias = self.window_biases.get(self.windows[index], self.bias)
        return StaticLayerCache(self.key_values[index], self.column, bias, self.kv_dtype)


def column_count(prompt_length: int, new_tokens: int) -> int:
    """The columns a StaticKVCache allocates for `prompt_length` prompt columns and `new_tokens` (module doc)."""
    return -(-(prompt_length + new_tokens) // COLUMN_MULTIPLE) * COLUMN_MULTIPLE


def repeated(prompts: int, repeats: int, device: torch.device | str) -> torch.Tensor:
    """`prompt_of_row` for `repeats` rows of each of `prompts` prompts, a prompt's rows together."""
    return torch.arange(prompts, device=device).repeat_interleave(repeats)


def bytes_per_row(
    prefill: DynamicCache,
    prompt_length: int,
    new_tokens: int,
    kv_dtype: torch.dtype,
    windows: Sequence[int | None] = (),
) -> int:
    """The bytes one row of the StaticKVCache built from `prefill` holds: every layer's keys and values (or states)
    and the masks, read from the prefill's own layers (so no model's shapes are assumed)."""
    columns = column_count(prompt_length, new_tokens)
    width = torch.empty((), dtype=kv_dtype).element_size()
    total = columns * (1 + width * (1 + len(set(windows) - {None})))  # `valid`, `bias` and the window biases
    for source in prefill.layers:
        if hasattr(source, "recurrent_states"):  # fp32 states, whatever the prompt's length
            total += sum(getattr(source, n)[0][0].numel() * 4 for n in STATE_NAMES)
        else:
            _, kv_heads, _, head_dim = source.keys.shape
            total += 2 * kv_heads * columns * head_dim * width
    return total


class StaticLayerCache:
    """One layer of a StaticKVCache: its buffer and the cache's shared column and bias. A decode step's layer takes
    this, not the cache and a layer number, so that a compiled layer serves every layer (compiled on a number, it
    would be a graph per layer)."""

    def __init__(self, key_values: torch.Tensor, column: torch.Tensor, bias: torch.Tensor, kv_dtype: torch.dtype):
        self.key_values, self.column, self.bias, self.kv_dtype = key_values, column, bias, kv_dtype

    def write(self, key_values: torch.Tensor) -> None:
        """key_values (rows, 2 * kv_heads, 1, head_dim), the keys then the values, in `kv_dtype`, into column
        `column`."""
        self.key_values.index_copy_(2, self.column, key_values)

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query (rows, heads, 1, head_dim) -> (rows, 1, heads, head_dim), in `kv_dtype`, over the valid columns (of
        a sliding-window layer, its window's: StaticKVCache.layer gave it that bias).

        The heads sharing a key/value head are that head's queries (a (rows, kv_heads, heads / kv_heads, dim)
        query), so grouped-query attention needs neither repeated keys nor enable_gqa."""
        rows, heads, _, dim = query.shape
        # the halves taken here, not kept as views: a compiled step given the buffer and views of it as separate
        # inputs copied the whole buffer twice a layer to write one column (inductor's handling of aliased inputs)
        keys, values = self.key_values.chunk(2, dim=1)
        grouped = query.reshape(rows, keys.shape[1], heads // keys.shape[1], dim).to(self.kv_dtype)
        out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=self.bias, scale=scaling
        )  # (rows, kv_heads, group, dim)
        return out.reshape(rows, 1, heads, dim)  # in `kv_dtype`, which the o product takes as it is

    def attend_eager(
        self,
        query: torch.Tensor,
        scaling: float,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """`attend` as transformers' eager attention computes it, for what sdpa has no input for: attention sinks
        (GPT-OSS: each head's `sinks` logit joins its scores in the softmax and adds no value, so it only takes
        weight from the keys; the softmax in the sinks' dtype) and soft-capped scores (Gemma 2: cap * tanh(s / cap),
        the softmax in fp32). The scores in `kv_dtype`."""
        rows, heads, _, dim = query.shape
        keys, values = self.key_values.chunk(2, dim=1)
        kv_heads = keys.shape[1]
        grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim).to(self.kv_dtype)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)) * scaling  # (rows, kv_heads, group, columns)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + self.bias
        if sinks is None:
            weights = scores.softmax(dim=-1, dtype=torch.float32)
        else:
            sink = sinks.reshape(1, kv_heads, heads // kv_heads, 1).expand(rows, -1, -1, 1)
            weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the cat promotes to the sinks'
        out = torch.matmul(weights.to(values.dtype), values)  # (rows, kv_heads, group, dim)
        return out.reshape(rows, 1, heads, dim)


class StaticStateLayer:
    """A linear-attention layer's states for decode steps, updated in place by the model's own recurrence
    (model_step.StaticCacheView), fp32: `conv_state` (rows, channels, kernel), the convolution's last inputs, oldest
    first; `recurrent_state` (rows, value heads, key dim, value dim)."""

    def __init__(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, kv_dtype: torch.dtype):
        self.conv_state, self.recurrent_state, self.kv_dtype = conv_state, recurrent_state, kv_dtype
