"""One decode step's attention, by each way there is to compute it: what the captured loop's attention costs a layer
on this device, and which way is fastest. On CUDA each way's 24 layers are captured as one CUDA graph and replayed,
as the captured loop replays its step; elsewhere they run eagerly.

    python bench/bench_decode_attention.py                  # the 0.5B case: 64 rows, 14 / 2 heads, 320 columns
    python bench/bench_decode_attention.py --columns 1344   # its 1,024-token shared prompt

The ways, over the loop's own cache (`StaticKVCache`: keys and values of a layer in one buffer, a bias of 0 / -inf,
the heads sharing a key/value head as its queries):
  sdpa              `StaticKVCache.attend` as it is: sdpa picks its kernel (cuDNN's on an H200, 11.4 us a layer)
  sdpa:efficient    the same call held to the memory-efficient kernel
  sdpa:cudnn        held to cuDNN's kernel
  sdpa:math         held to sdpa's composite of operators
  products          two batched products and an fp32 softmax, as transformers' eager attention computes it
Each way's output is checked against `sdpa`'s (bf16: 2e-2) before it is timed; a way the device cannot run is
reported with its error. Prints one JSON line per way: median microseconds per layer over `--repeat` timings.
Results: docs/benchmarks-gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from types import SimpleNamespace
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from graph_timing import seconds_per_call  # noqa: E402

from grouprl.generation.static_kv_cache import StaticKVCache  # noqa: E402

BACKENDS = {
    "sdpa:efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa:cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa:math": SDPBackend.MATH,
}


def build_cache(layers: int, rows: int, kv_heads: int, columns: int, dim: int, device: str) -> StaticKVCache:
    """A cache as a generate call leaves it mid-way, made by the loop's own constructor: a prompt of random keys and
    values over the first three quarters of the columns (its first 5 columns padding in every third row), the last
    quarter not yet written."""
    prompt = columns * 3 // 4
    prefill = SimpleNamespace(
        layers=[
            SimpleNamespace(
                keys=torch.randn(rows, kv_heads, prompt, dim, dtype=torch.bfloat16, device=device),
                values=torch.randn(rows, kv_heads, prompt, dim, dtype=torch.bfloat16, device=device),
            )
            for _ in range(layers)
        ]
    )
    mask = torch.ones(rows, prompt, dtype=torch.long, device=device)
    mask[::3, :5] = 0  # left padding
    rows_prompts = torch.arange(rows, device=device)
    return StaticKVCache(prefill, mask, rows_prompts, new_tokens=columns - prompt, kv_dtype=torch.bfloat16)


def explicit_products(cache: StaticKVCache, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with the softmax in fp32, the grouped heads as `attend` groups them."""
    rows, heads, _, dim = query.shape
    keys, values = cache.key_values[layer].chunk(2, dim=1)
    grouped = (query * scaling).reshape(rows, keys.shape[1], heads // keys.shape[1], dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) + cache.bias
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values).reshape(rows, 1, heads, dim)


def way(name: str) -> Callable[[StaticKVCache, int, torch.Tensor, float], torch.Tensor]:
    if name == "products":
        return explicit_products
    backend = BACKENDS.get(name)

    def attend(cache: StaticKVCache, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            return cache.layer(layer).attend(query, scaling)

    return attend


def layer_seconds(attend, cache: StaticKVCache, queries: list[torch.Tensor], repeat: int, per_timing: int) -> list:
    """Seconds per layer: `repeat` timings of `per_timing` passes over every layer (one replayed graph on CUDA)."""
    scaling = queries[0].shape[-1] ** -0.5

    def every_layer() -> None:
        for layer, query in enumerate(queries):
            attend(cache, layer, query, scaling)

    seconds = seconds_per_call(every_layer, queries[0].device.type == "cuda", repeat, per_timing)
    return [s / len(queries) for s in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--columns", type=int, default=320, help="the cache's columns (prompt bucket + new tokens)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--per-timing", type=int, default=20)
    parser.add_argument("--ways", default="sdpa,sdpa:efficient,sdpa:cudnn,sdpa:math,products")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    cache = build_cache(args.layers, args.rows, args.kv_heads, args.columns, args.head_dim, args.device)
    queries = [
        torch.randn(args.rows, args.heads, 1, args.head_dim, dtype=torch.bfloat16, device=args.device)
        for _ in range(args.layers)
    ]
    scaling = args.head_dim**-0.5
    reference = cache.layer(0).attend(queries[0], scaling).float()
    shape = {"rows": args.rows, "heads": args.heads, "kv_heads": args.kv_heads, "columns": args.columns}
    for name in args.ways.split(","):
        record = {"way": name, "device": args.device, **shape}
        try:
            attend = way(name)
            gap = float((attend(cache, 0, queries[0], scaling).float() - reference).abs().max())
            if gap > 2e-2:
                raise AssertionError(f"differs from sdpa's output by {gap:.3g}")
            seconds = layer_seconds(attend, cache, queries, args.repeat, args.per_timing)
            record.update(median_us_per_layer=statistics.median(seconds) * 1e6, largest_gap=gap)
        except Exception as err:  # a kernel this device lacks: reported, the other ways still run
            record["error"] = f"{type(err).__name__}: {str(err).strip()[:300]}"
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
