"""KV caches that are allocated once per generation and written in place.

transformers' DynamicLayer appends a decode step's keys and values with `torch.cat`, which
allocates a new (rows, kv_heads, length, head_dim) tensor and copies the whole cache, in every
layer, at every step; on a CPU the fresh allocation of a few MB also costs a page fault per 4 KiB
(see model/patches.py). Measured on W4's generation (alternating runs): 4.1-5.0 s with concatenation,
3.0-4.2 s with these buffers. Here each layer's keys and values live in one buffer sized for the prompt
plus every new token; a step writes one column and the layer hands attention a view of the
filled part. Rows that finish are compacted in place (`compact_rows`), copying only the filled
part of the surviving rows.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def compact_rows(buffer: torch.Tensor, keep: torch.Tensor, filled: int) -> torch.Tensor:
    """Move rows `keep` of `buffer` (rows, heads, capacity, dim) to its front; only `filled` columns are copied.

    Returns the view of the first len(keep) rows. The right-hand side is gathered into a new tensor
    before it is written, so overlapping source and destination rows are safe.
    """
    rows = keep.shape[0]
    buffer[:rows, :, :filled] = buffer[keep, :, :filled]
    return buffer[:rows]


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of buffers with room for `capacity` positions."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        rows, heads, length, dim = keys.shape
        if capacity < length:
            raise ValueError(f"PreallocatedLayer: capacity {capacity} is below the {length} positions already cached.")
        self.key_buffer = keys.new_empty(rows, heads, capacity, dim)
        self.value_buffer = values.new_empty(rows, heads, capacity, values.shape[-1])
        self.key_buffer[:, :, :length] = keys
        self.value_buffer[:, :, :length] = values
        self.length = length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._expose()

    def _expose(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        end = self.length + new
        if end > self.key_buffer.shape[2]:
            raise RuntimeError(f"PreallocatedLayer: {end} positions exceed the capacity of {self.key_buffer.shape[2]}.")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer = compact_rows(self.key_buffer, indices, self.length)
        self.value_buffer = compact_rows(self.value_buffer, indices, self.length)
        self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "PreallocatedLayer: repeat the cache before preallocating it (buffers are sized once)."
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PreallocatedLayer: cropping is not used by the engine.")


def preallocate(cache: DynamicCache, new_tokens: int) -> DynamicCache:
    """Give every plain DynamicLayer of `cache` buffers for `new_tokens` more positions (other layer types stay)."""
    cache.layers = [
        PreallocatedLayer(layer.keys, layer.values, layer.keys.shape[-2] + new_tokens)
        if type(layer) is DynamicLayer and layer.is_initialized
        else layer
        for layer in cache.layers
    ]
    return cache
