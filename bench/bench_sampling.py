"""One draw per row from (rows, vocabulary) logits, by each of sampling.py's methods: what the decode step's sampling
costs on this device. On CUDA each method's draw is captured as a CUDA graph and replayed, as the captured loop
replays its step; elsewhere it runs eagerly.

    python bench/bench_sampling.py                         # 64 rows x 151,936 (the GPU benchmark's 0.5B case)
    python bench/bench_sampling.py --rows 8 --vocab 4096 --repeat 50

`inverse_cdf` (the default) accumulates each row's probabilities in float64 and searches one uniform number in them;
`multinomial` is torch.multinomial, which for one draw divides the probabilities by exponential variates and takes
the argmax (the variates are the random stream transformers' `generate` consumes). Both sample the same
distribution (tests/test_sampling.py); this says which is faster here. Prints one JSON line per method: median
microseconds per draw over `--repeat` timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from graph_timing import seconds_per_call  # noqa: E402

from grouprl.generation.sampling import SAMPLING_METHODS, sample_tokens  # noqa: E402


def draw_seconds(method: str, logits: torch.Tensor, repeat: int, per_timing: int) -> list[float]:
    """Seconds per draw, `repeat` timings of `per_timing` draws each (replayed from a CUDA graph on CUDA)."""
    return seconds_per_call(
        lambda: sample_tokens(logits, method=method), logits.device.type == "cuda", repeat, per_timing
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeat", type=int, default=7, help="timings per method (the median is reported)")
    parser.add_argument("--per-timing", type=int, default=20, help="draws per timing")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, device=args.device) * 3  # processed logits: fp32, as the step's
    for method in SAMPLING_METHODS:
        seconds = draw_seconds(method, logits, args.repeat, args.per_timing)
        print(
            json.dumps(
                {
                    "method": method,
                    "device": args.device,
                    "rows": args.rows,
                    "vocab": args.vocab,
                    "median_us_per_draw": statistics.median(seconds) * 1e6,
                    "us_per_draw": [round(s * 1e6, 1) for s in seconds],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
