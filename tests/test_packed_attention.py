"""packed_attention (visible pairs only) against sdpa with the pack's dense 4D mask."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from grouprl.model import packed_attention
from grouprl.model.pack_building import build_pack
from grouprl.model.packed_attention import LAYOUT_KWARG, sdpa_or_packed


def _pack():
    """Two packs: prompt of 3 with completions of 4, 2 and 0 tokens; prompt of 5 with one of 3 (padded to L = 9)."""
    return build_pack([[1, 2, 3], [4, 5, 6, 7, 8]], [[[9] * 4, [9] * 2, []], [[9] * 3]], 4, torch.device("cpu"))


def _real_positions(pack) -> torch.Tensor:
    return torch.arange(pack.input_ids.shape[1]) < torch.tensor(
        [[3 + 4 + 2], [5 + 3]]
    )  # the second pack ends in one pad


@pytest.mark.parametrize("grouped_kernel", [True, False], ids=["enable_gqa", "repeated heads"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_values_and_gradients_equal_dense_masked_sdpa(kv_heads, grouped_kernel, monkeypatch):
    """Grouped-query attention both ways: the CPU kernel's grouped heads, and heads
    repeated (other devices, torch < 2.5)."""
    monkeypatch.setattr(packed_attention, "SDPA_TAKES_GROUPED_HEADS", grouped_kernel)
    pack = _pack()
    packs, length = pack.input_ids.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(packs, h, length, 8, generator=g, requires_grad=True) for h in (4, kv_heads, kv_heads))
    module = types.SimpleNamespace(num_key_value_groups=4 // kv_heads, is_causal=True)
    got, _ = sdpa_or_packed(module, q, k, v, None, scaling=0.3, **{LAYOUT_KWARG: pack.layout})
    rep = 4 // kv_heads
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=pack.attention_mask, scale=0.3
    )
    expected = expected.transpose(1, 2)  # (packs, L, H, D) like transformers' attention functions
    real = _real_positions(pack)
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-6)
    assert torch.all(got[~real] == 0)
    weights = torch.randn(got.shape, generator=g) * real[..., None, None]
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_layout_visibility_is_the_dense_mask():
    """Rebuild the (packs, L, L) visibility from the layout's index tensors: it must be the 4D mask, pair for pair."""
    pack = _pack()
    lay = pack.layout
    packs, length = pack.input_ids.shape
    seen = torch.zeros(packs * length, packs * length, dtype=torch.bool)
    p = lay.prompt_width
    for b in range(packs):
        for i in range(p):
            for j in range(p):
                if lay.prompt_mask[b, 0, i, j] and b * p + i in lay.prompt_rows.tolist():
                    seen[b * length + i, b * length + j] = True
    for n, (rows, b) in enumerate(zip(lay.completion_index.tolist(), lay.completion_pack.tolist())):
        keys = [b * length + j for j in range(p)] + rows
        for i, query in enumerate(rows):
            if n * len(rows) + i not in lay.completion_rows.tolist():
                continue
            for j, key in enumerate(keys):
                if lay.completion_mask[n, 0, i, j]:
                    seen[query, key] = True
    dense = torch.block_diag(*[pack.attention_mask[b, 0] for b in range(packs)])
    real = _real_positions(pack).reshape(-1)
    assert torch.equal(seen[real][:, real], dense[real][:, real])
    assert (
        sorted(lay.targets.tolist()) == real.nonzero().squeeze(1).tolist()
    )  # every real position gets an output, once


def test_calls_without_a_layout_are_transformers_sdpa(monkeypatch):
    seen = []
    monkeypatch.setattr(packed_attention, "sdpa_attention_forward", lambda *a, **k: seen.append(k) or "sdpa")
    assert sdpa_or_packed(None, None, None, None, None, dropout=0.0, **{LAYOUT_KWARG: None}) == "sdpa"
    assert seen == [{"dropout": 0.0}]  # the layout keyword is not passed on


def test_refuses_sliding_windows():
    pack = _pack()
    q = torch.zeros(2, 4, pack.input_ids.shape[1], 8)
    with pytest.raises(NotImplementedError, match="full-attention"):
        packed_attention.packed_attention(None, q, q, q, None, sliding_window=4, **{LAYOUT_KWARG: pack.layout})
