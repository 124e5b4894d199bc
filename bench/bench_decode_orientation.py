"""Decode products on SmolLM2-135M's shapes: x @ W^T (F.linear) vs (W @ x^T)^T
(grouprl's weight-major path), fp32 and bf16.

python bench/bench_decode_orientation.py
"""

import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
shapes = (
    [(576, 576)] * 2 + [(192, 576)] * 2 + [(1536, 576)] * 2 + [(576, 1536)] + [(49152, 576)]
)  # q,o,k,v,gate,up,down,head


def best(fn, n=9):
    fn()
    ts = []
    for _ in range(n):
        s = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - s)
    return min(ts)


for dtype in (torch.float32, torch.bfloat16):
    W = [[torch.randn(o, i, dtype=dtype) for (o, i) in shapes] for _ in range(4)]  # 4 layers' worth of distinct weights
    for rows in (8, 16, 32):
        X = {i: torch.randn(rows, i, dtype=dtype) for (_, i) in shapes}

        # timed right here, inside this iteration: binding W and X as defaults only makes that explicit
        def lin(W=W, X=X):
            return [F.linear(X[w.shape[1]], w) for ws in W for w in ws]

        def wm(W=W, X=X):
            return [torch.mm(w, X[w.shape[1]].t()).t().contiguous() for ws in W for w in ws]

        a = []
        b = []
        for _ in range(3):
            a.append(best(lin))
            b.append(best(wm))
        print(
            f"{str(dtype)[6:]:9s} rows {rows:2d}: F.linear {1e3 * min(a):7.2f} ms  weight-major {1e3 * min(b):7.2f} "
            f"ms  ratio {min(a) / min(b):.2f}x",
            flush=True,
        )
