"""Weight-major decode products: the same values as F.linear, only where they are meant to apply."""

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

from grouprl.generation import cpu_products
from grouprl.generation.cpu_products import (
    pack_weight,
    packed_linear,
    packs_weights,
    weight_major_decode,
    weight_major_linear,
)


def _layer(bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(48, 80, bias=bias)


@torch.no_grad()
def test_values_equal_f_linear_for_every_row_count_and_shape():
    for bias in (True, False):
        layer = _layer(bias)
        for shape in [(1, 48), (2, 48), (5, 1, 48), (32, 1, 48), (3, 4, 48), (40, 48)]:
            x = torch.randn(*shape)
            got = weight_major_linear(layer, x)
            assert got.shape == (*shape[:-1], 80) and got.is_contiguous()
            assert torch.allclose(got, F.linear(x, layer.weight, layer.bias), atol=1e-5), (bias, shape)


def test_autograd_and_other_dtypes_keep_f_linear_exactly():
    layer = _layer(True)
    x = torch.randn(4, 48)
    with torch.enable_grad():
        assert torch.equal(weight_major_linear(layer, x), F.linear(x, layer.weight, layer.bias))
    with torch.no_grad():
        half = layer.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        assert torch.equal(weight_major_linear(half, xb), F.linear(xb, half.weight, half.bias))


@torch.no_grad()
def test_context_switches_plain_linears_only_and_restores_them():
    class Custom(torch.nn.Linear):  # a subclass (quantized layers are) keeps its own forward
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Custom(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 8)
    expected = model(x)
    with weight_major_decode(model):
        assert "forward" in vars(model[0]) and "forward" in vars(model[3]) and "forward" not in vars(model[1])
        assert torch.allclose(model(x), expected, atol=1e-6)
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(model(x), expected)
    elsewhere = torch.nn.Linear(8, 8, device="meta")  # not on the CPU: never patched
    with weight_major_decode(elsewhere):
        assert "forward" not in vars(elsewhere)


@torch.no_grad()
def test_few_rows_take_the_weight_major_product_and_many_rows_do_not():
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            self.names.append(name)
            if name == "addmm":
                self.columns = args[2].shape[1]  # rows as the product saw them
            return func(*args, **(kwargs or {}))

    layer = _layer(True)
    for rows, expected, columns in [
        (1, "linear", None),
        (2, "addmm", 2),
        (8, "addmm", 8),
        (9, "addmm", 16),
        (31, "addmm", 32),
        (32, "addmm", 32),
        (33, "linear", None),
    ]:
        with Calls() as calls:
            weight_major_linear(layer, torch.randn(rows, 1, 48))
        assert expected in calls.names and ({"linear", "addmm"} - {expected}).isdisjoint(calls.names), (
            rows,
            calls.names,
        )
        if columns is not None:  # from 9 rows on, padded with zero rows to a multiple of 16
            assert calls.columns == columns, rows


@pytest.mark.skipif(
    not packs_weights(torch.bfloat16, torch.device("cpu")),
    reason="oneDNN here runs no bf16 products from packed weights (an AVX2-only CPU, or the instruction set held)",
)
@pytest.mark.parametrize("rows", [1, 7, 32, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_bf16_products_equal_f_linear(rows, bias):
    """A weight packed once gives F.linear's bf16 results at any row count (the decode step's rows shrink)."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 40, generator=g).bfloat16()
    packed = pack_weight(weight)
    assert packed.is_mkldnn
    got, want = packed_linear(x, packed, b), F.linear(x, weight, b)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_only_bf16_cpu_products_are_packed():
    assert not packs_weights(torch.float32, torch.device("cpu"))
    assert not packs_weights(torch.bfloat16, torch.device("meta"))


def test_packed_weights_are_declined_where_onednn_runs_no_bf16_and_the_reason_is_logged(monkeypatch, caplog):
    """An AVX2-only CPU (or ONEDNN_MAX_CPU_ISA=AVX2): torch says oneDNN runs no bf16, so nothing is packed."""
    monkeypatch.setattr(cpu_products, "onednn_runs_bf16", lambda: False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(cpu_products, "pack_weight", lambda w: pytest.fail("packed a weight oneDNN cannot run"))
    with fresh_verdict(), caplog.at_level(logging.INFO, logger="grouprl"):
        assert not packs_weights(torch.bfloat16, torch.device("cpu"))
        assert not packs_weights(torch.bfloat16, torch.device("cpu"))
    assert caplog.text.count("use F.linear, not packed weights") == 1 and "ONEDNN_MAX_CPU_ISA=AVX2" in caplog.text


def test_a_packed_product_that_is_not_supported_is_declined_and_other_errors_propagate(monkeypatch, caplog):
    monkeypatch.setattr(cpu_products, "onednn_runs_bf16", lambda: True)

    def unsupported(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(cpu_products, "pack_weight", unsupported)
    with fresh_verdict(), caplog.at_level(logging.INFO, logger="grouprl"):
        assert not packs_weights(torch.bfloat16, torch.device("cpu"))
    assert "a packed product failed: RuntimeError: mkldnn_reorder_linear_weight" in caplog.text

    def out_of_memory(weight):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(cpu_products, "pack_weight", out_of_memory)
    with fresh_verdict(), pytest.raises(torch.OutOfMemoryError):
        packs_weights(torch.bfloat16, torch.device("cpu"))


@contextlib.contextmanager
def fresh_verdict():
    """packed_bf16_runs decides once per process: ask again inside the block, and let the next caller ask again."""
    cpu_products.packed_bf16_runs.cache_clear()
    try:
        yield
    finally:
        cpu_products.packed_bf16_runs.cache_clear()
