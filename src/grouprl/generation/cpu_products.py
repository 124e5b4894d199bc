"""The CPU products of decode steps: few fp32 rows in the weight-major orientation (`few_row_linear`), bf16 rows
by weights packed once for oneDNN (`packed_linear`).

A decode step multiplies a handful of rows (one token per sequence still running) by every weight
matrix. `F.linear` computes that as x @ W^T; the same product computed as (W @ x^T)^T, the weight as
the left-hand operand, runs faster in the CPU BLAS that PyTorch uses here, provided the number of
rows suits its kernels: from 9 rows on, rows are padded with zeros to a multiple of 16 (31 rows, a
W1/W2 step after one sequence finished, are much slower than 32). Median of 11 runs, 8 distinct
weights per shape, fp32, this project's 2-core AVX2 machine, summed over W1's five weight shapes
and 12 row counts from 2 to 31: x @ W^T 274 ms, W @ x^T unpadded 277 ms (better at 2-8 rows, worse at 15, 30, 31),
W @ x^T with the padding 228 ms. A whole decode step of W4's model: 1.6x faster at 2-4 rows;
W3's, with its 151,936-row head, 1.9x at 8 rows.

bf16 products go through oneDNN, which `F.linear` asks to reorder the weight into its blocked
layout at every call. `pack_weight` does that once and `packed_linear` multiplies with the packed
weight (the results are those of `F.linear`); both decode steps (fused_step.py, model_step.py) pack their weights
once per generate call, where oneDNN runs bf16 on this CPU (`packed_bf16_runs`; not on an AVX2-only one).
SmolLM2-135M's 30 layers and head, one decode step, median of 30, 2-core AVX512-BF16 CPU: 37.0 -> 28.4 ms
at 32 rows, 25.1 -> 15.9 at 16, 19.8 -> 11.3 at 8.

Results differ from `F.linear` by summation order only (about 1e-6 in the logits). Only float32
inputs on the CPU without autograd take it, with 2-32 rows: GPUs' BLAS and bf16 kernels have their
own shape heuristics and were not measured, 1 row is a matrix-vector product either way, and from
about 128 rows x @ W^T is faster. Training passes keep `F.linear`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers.utils import logging

from grouprl.core.cpu_capabilities import isa_limits, onednn_runs_bf16
from grouprl.model.forward import describe, is_unsupported

logger = logging.get_logger("grouprl")

FEW_ROWS = range(2, 33)
UNPADDED_ROWS = 8  # above this, rows are padded to a multiple of 16


def weight_major_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, as (W @ x^T)^T when x has few rows (see the module doc), else `F.linear`."""
    return few_row_linear(x, layer.weight, layer.bias)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, as (W @ x^T)^T when x has few fp32 rows on the CPU and no autograd."""
    if torch.compiler.is_compiling():  # a traced step's shapes may be symbolic; inductor picks its own kernels
        return F.linear(x, weight, bias)
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if (
        rows not in FEW_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, features)
    if rows > UNPADDED_ROWS and rows % 16:  # zero rows up to a multiple of 16 (module doc)
        padded = flat.new_zeros(-(-rows // 16) * 16, features)
        padded[:rows] = flat
        flat = padded
    columns = flat.t()
    if bias is None:
        out = torch.mm(weight, columns)
    else:
        out = torch.addmm(bias[:, None], weight, columns)
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])


def packs_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products in `dtype` on `device` run from packed weights: bf16 on a CPU whose oneDNN runs them."""
    return dtype == torch.bfloat16 and device.type == "cpu" and packed_bf16_runs()


@functools.cache
def packed_bf16_runs() -> bool:
    """Whether oneDNN here multiplies bf16 rows by a packed weight: asked of torch (which knows the CPU and the
    instruction-set limits in force, core/cpu_capabilities.py), then tried once on a tiny weight. Without it (an
    AVX2-only CPU: "bf16 path needs the cpu support ...") the products run through `F.linear`. Logged once."""
    reason = None
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        reason = "this torch build has no oneDNN weight packing"
    elif not onednn_runs_bf16():
        limit = isa_limits().get("ONEDNN_MAX_CPU_ISA")
        held = f"ONEDNN_MAX_CPU_ISA={limit}" if limit else "it needs AVX512BW/VL/DQ or AVX-NE-CONVERT"
        reason = f"oneDNN runs no bf16 products on this CPU ({held})"
    else:
        try:
            packed_linear(
                torch.ones(2, 16, dtype=torch.bfloat16), pack_weight(torch.ones(16, 16, dtype=torch.bfloat16))
            )
        except Exception as err:
            if not is_unsupported(err):
                raise
            reason = f"a packed product failed: {describe(err)}"
    if reason is None:
        logger.info("grouprl: bf16 decode products on the CPU use weights packed once for oneDNN.")
    else:
        logger.info(f"grouprl: bf16 decode products on the CPU use F.linear, not packed weights: {reason}.")
    return reason is None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) bf16 CPU weight reordered once into oneDNN's layout, for `packed_linear` (module doc)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for (rows, in) `x`, with the weight as `pack_weight` returned it."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@contextlib.contextmanager
def weight_major_decode(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's plain `nn.Linear` layers use `weight_major_linear`.

    Subclasses (quantized layers, ...) and layers whose forward is already replaced keep their own.
    A model whose layers are not on the CPU is left alone (no per-call check on a path that never applies).
    """
    layers = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear and "forward" not in vars(m) and m.weight.device.type == "cpu"
    ]
    for layer in layers:
        layer.forward = functools.partial(weight_major_linear, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
