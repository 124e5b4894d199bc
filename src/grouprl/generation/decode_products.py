"""Decode-step linear layers computed in the weight-major orientation on CPU.

A decode step multiplies a handful of rows (one token per sequence still running) by every weight
matrix. `F.linear` computes that as x @ W^T; with 2 to 32 rows of x the CPU BLAS that PyTorch uses
here takes a slow path for it. The same product computed as (W @ x^T)^T, the weight as the
left-hand operand, is measured on this project's machine (fp32, AVX2, 2 threads):

| rows | decode step, W4's 30M model | decode step, W3's 151,936-token head |
|---|---|---|
| 1 | 0.93x (so 1 row keeps F.linear) | 1.00x |
| 2-4 | 1.6x faster | 2.2x faster |
| 8 | 1.08x | 1.9x |
| 16-32 | 1.05x | 1.14-1.28x |

and slower from about 128 rows, which is why only 2-32 rows take it. Results differ from
`F.linear` by summation order only (about 1e-6 in the logits). Only float32 inputs on the CPU
without autograd take it: GPUs' BLAS and bf16 kernels have their own shape heuristics and were not
measured, and training passes keep `F.linear`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

FEW_ROWS = range(2, 33)


def weight_major_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, as (W @ x^T)^T when x has few rows (see the module doc), else `F.linear`."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if rows not in FEW_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return F.linear(x, layer.weight, layer.bias)
    columns = x.reshape(rows, features).t()
    if layer.bias is None:
        out = torch.mm(layer.weight, columns)
    else:
        out = torch.addmm(layer.bias[:, None], layer.weight, columns)
    return out.t().contiguous().view(*x.shape[:-1], layer.weight.shape[0])


@contextlib.contextmanager
def weight_major_decode(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's plain `nn.Linear` layers use `weight_major_linear`.

    Subclasses (quantized layers, ...) and layers whose forward is already replaced keep their own.
    """
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in vars(m)]
    for layer in layers:
        layer.forward = functools.partial(weight_major_linear, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
