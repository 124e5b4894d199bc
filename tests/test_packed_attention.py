"""packed_attention (visible pairs only) against sdpa with the pack's dense 4D mask."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as F

from grouprl.model import packed_attention
from grouprl.model.packed_attention import LAYOUT_KWARG, sdpa_or_packed
from grouprl.model.prompt_packing import build_pack


def _pack(concatenate: bool = False):
    """Two packs: prompt of 3 with completions of 4, 2 and 0 tokens; prompt of 5 with one of 3. One per row (L = 9,
    the second row ends in one pad) or one after the other in a single row (L = 17, no padding)."""
    return build_pack(
        [[1, 2, 3], [4, 5, 6, 7, 8]],
        [[[9] * 4, [9] * 2, []], [[9] * 3]],
        4,
        torch.device("cpu"),
        concatenate=concatenate,
    )


def _real_positions(pack) -> torch.Tensor:
    if pack.input_ids.shape[0] == 1:
        return torch.ones(pack.input_ids.shape, dtype=torch.bool)
    return torch.arange(pack.input_ids.shape[1]) < torch.tensor([[3 + 4 + 2], [5 + 3]])


@pytest.mark.parametrize("grouped_kernel", [True, False], ids=["enable_gqa", "repeated heads"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("concatenate", [False, True], ids=["pack per row", "packs in one row"])
@pytest.mark.parametrize("explicit_scores", [False, True], ids=["sdpa kernel", "explicit products"])
def test_values_and_gradients_equal_dense_masked_sdpa(
    kv_heads, grouped_kernel, concatenate, explicit_scores, monkeypatch
):
    """Grouped-query attention both ways: the CPU kernel's grouped heads, and heads
    repeated (other devices, torch < 2.5); attending by sdpa's kernel or by explicit products."""
    monkeypatch.setattr(packed_attention, "SDPA_TAKES_GROUPED_HEADS", grouped_kernel)
    pack = _pack(concatenate)
    pack = pack._replace(layout=pack.layout._replace(explicit_scores=explicit_scores))
    # the explicit products serve half-precision products only; here they are checked in fp32 against exact values
    monkeypatch.setattr(packed_attention, "_explicit_products_pay_off", lambda query: True)
    calls = []
    real = packed_attention.grouped_attention
    monkeypatch.setattr(packed_attention, "grouped_attention", lambda *a: calls.append(a[1].shape[1]) or real(*a))
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
    # the prompts' attention and the completions', each with the key/value heads as they are (never repeated)
    assert calls == ([kv_heads, kv_heads] if explicit_scores else [])


@pytest.mark.parametrize("concatenate", [False, True], ids=["pack per row", "packs in one row"])
def test_layout_visibility_is_the_dense_mask(concatenate):
    """Rebuild the (rows * L)^2 visibility from the layout's index tensors: it must be the 4D mask, pair for pair."""
    pack = _pack(concatenate)
    lay = pack.layout
    rows, length = pack.input_ids.shape
    seen = torch.zeros(rows * length, rows * length, dtype=torch.bool)
    p = lay.prompt_width
    for b, prompt in enumerate(lay.prompt_index.tolist()):
        for i, query in enumerate(prompt):
            if b * p + i not in lay.prompt_rows.tolist():
                continue
            for j, key in enumerate(prompt):
                if lay.prompt_mask[b, 0, i, j]:
                    seen[query, key] = True
    for n, (own, b) in enumerate(zip(lay.completion_index.tolist(), lay.completion_prompt.tolist())):
        keys = lay.prompt_index[b].tolist() + own
        for i, query in enumerate(own):
            if n * len(own) + i not in lay.completion_rows.tolist():
                continue
            for j, key in enumerate(keys):
                if lay.completion_mask[n, 0, i, j]:
                    seen[query, key] = True
    dense = torch.block_diag(*[pack.attention_mask[r, 0] for r in range(rows)])
    real = _real_positions(pack).reshape(-1)
    assert torch.equal(seen[real][:, real], dense[real][:, real])
    assert (
        sorted(lay.targets.tolist()) == real.nonzero().squeeze(1).tolist()
    )  # every real position gets an output, once


def test_packs_in_one_row_by_hand():
    """Two packs in one row: each keeps its own positions and sees nothing of the other."""
    pack = build_pack([[11, 12], [13]], [[[21, 22], [31]], [[41, 42]]], 2, torch.device("cpu"), concatenate=True)
    assert pack.input_ids.tolist() == [[11, 12, 21, 22, 31, 13, 41, 42]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    assert pack.source.tolist() == [[1, 2], [1, 1], [5, 6]]
    visible = pack.attention_mask[0, 0].int().tolist()
    assert visible[4] == [1, 1, 0, 0, 1, 0, 0, 0]  # the second completion of pack 0: its prompt and itself
    assert visible[7] == [0, 0, 0, 0, 0, 1, 1, 1]  # pack 1 sees only its own prompt and completion
    assert pack.keep == 7  # from the first prompt's last token on


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


def test_explicit_products_round_as_eager_attention_under_bf16_autocast():
    """Under bf16 autocast the explicit products are eager attention's arithmetic (bf16 products, fp32 softmax) with
    the scale applied to the queries: as close to the fp32 result as eager's, and to sdpa's kernel within bf16
    rounding."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(4, 6, 16, 8, generator=g),
        torch.randn(4, 2, 24, 8, generator=g),
        torch.randn(4, 2, 24, 8, generator=g),
    )
    mask = torch.rand(4, 1, 16, 24, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key
    exact = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = packed_attention.grouped_attention(q, k, v.bfloat16(), mask, 0.3)
        scores = (q @ k.repeat_interleave(3, 1).transpose(-1, -2)) * 0.3
        probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1).bfloat16()
        eager = probs @ v.repeat_interleave(3, 1).bfloat16()
        scaled_first = (q * 0.3) @ k.repeat_interleave(3, 1).transpose(-1, -2)
        probs = scaled_first.float().masked_fill(~mask, float("-inf")).softmax(-1).bfloat16()
        same_arithmetic = probs @ v.repeat_interleave(3, 1).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), same_arithmetic.float(), rtol=0, atol=1e-3)
    assert (got.float() - exact).abs().max() <= 2 * (eager.float() - exact).abs().max() + 1e-3


def test_explicit_products_only_for_half_precision_products_at_native_speed(monkeypatch):
    q32 = torch.zeros(1, 2, 3, 4)
    monkeypatch.setattr(packed_attention, "_cpu_runs_half_products_natively", lambda: True)
    assert not packed_attention._explicit_products_pay_off(q32)
    assert packed_attention._explicit_products_pay_off(q32.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed_attention._explicit_products_pay_off(q32)
    monkeypatch.setattr(packed_attention, "_cpu_runs_half_products_natively", lambda: False)  # bf16 emulated
    assert not packed_attention._explicit_products_pay_off(q32.bfloat16())
    # a GPU takes sdpa's kernel (the H200's training pass: faster and lighter); meta stands for any accelerator
    assert not packed_attention._explicit_products_pay_off(q32.bfloat16().to("meta"))


def test_a_cpu_that_emulates_bf16_keeps_sdpa_and_says_why_once(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(packed_attention, "bf16_emulation_reason", lambda: calls.append(1) or "no bf16 units here")
    decide = packed_attention._cpu_runs_half_products_natively
    decide.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="grouprl"):
            assert not decide() and not decide()
        assert len(calls) == 1 and caplog.text.count("runs sdpa's kernel, not explicit bf16 products") == 1
        assert "no bf16 units here" in caplog.text
    finally:
        decide.cache_clear()  # the next caller asks this machine again
