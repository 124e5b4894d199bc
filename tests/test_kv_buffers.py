"""Preallocated KV buffers: in-place writes and row compaction equal transformers' concatenating cache."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from grouprl.generation.kv_buffers import PreallocatedLayer, compact_rows


def test_compact_rows_equals_indexing_even_when_rows_overlap():
    buffer = torch.randn(6, 2, 10, 4)
    before = buffer.clone()
    keep = torch.tensor([1, 2, 5])  # row 2 moves to slot 1 while row 1 moves to slot 0: overlapping
    out = compact_rows(buffer, keep, filled=7)
    assert out.shape == (3, 2, 10, 4)
    assert torch.equal(out[:, :, :7], before[keep, :, :7])


def test_preallocated_layer_follows_dynamic_layer_through_steps_and_row_drops():
    torch.manual_seed(0)
    prompt_k, prompt_v = torch.randn(5, 2, 3, 4), torch.randn(5, 2, 3, 4)
    reference = DynamicLayer()
    reference.update(prompt_k, prompt_v)
    layer = PreallocatedLayer(prompt_k, prompt_v, capacity=3 + 4)
    for step, keep in enumerate([None, torch.tensor([0, 2, 3, 4]), None, torch.tensor([1, 3])]):
        if keep is not None:
            reference.batch_select_indices(keep)
            layer.batch_select_indices(keep)
        rows = reference.keys.shape[0]
        k, v = torch.randn(rows, 2, 1, 4), torch.randn(rows, 2, 1, 4)
        expected = reference.update(k, v)
        got = layer.update(k, v)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), f"step {step}"
        assert layer.get_seq_length() == reference.get_seq_length()


def test_preallocated_layer_names_its_capacity_when_overrun():
    layer = PreallocatedLayer(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), capacity=3)
    layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    with pytest.raises(RuntimeError, match="capacity of 3"):
        layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
