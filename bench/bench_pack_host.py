"""Host time to build one row of packed sequences (model/prompt_packing.build_pack), as the training pass builds it
for the GPU benchmark's cases with 48-token prompts (bench/gpu/bench_generation.PLAN): 8 completions of 256 tokens
behind each prompt, 3 packs in a 6,288-token row (the 0.5B case), and one pack of 1,024-token completions, 8,240
tokens (the 1.5B case).

    python bench/bench_pack_host.py

`cpu`: every tensor on the host, what building the dense (L, L) mask there and copying it cost before the masks
were made on the model's device; `meta`: the device's work takes no time, so what is left is the host's part when
the model is on a GPU; `meta, no dense mask`: a pack for packed attention (`dense_mask=False`). Median of 5.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from grouprl.model.prompt_packing import CONCATENATED_ROW_TOKENS, build_pack

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
from bench_generation import PLAN  # noqa: E402  (the GPU benchmark's cases)

CASES = [PLAN[0], PLAN[2]]  # the 0.5B and 1.5B cases with 48-token prompts


def packs_in_a_row(case) -> tuple[int, int]:
    """(packs, tokens) of one row: as many packs as it holds (prompt_packing.concatenated_rows)."""
    pack = case.prompt_tokens + case.generations * case.new_tokens
    packs = max(CONCATENATED_ROW_TOKENS // pack, 1)
    return packs, packs * pack


def host_ms(case, device: str, dense_mask: bool) -> float:
    packs, _ = packs_in_a_row(case)
    prompts = [list(range(case.prompt_tokens))] * packs
    completions = [[list(range(case.new_tokens))] * case.generations] * packs
    times = []
    for _ in range(6):
        started = time.perf_counter()
        build_pack(prompts, completions, case.new_tokens, torch.device(device), concatenate=True, dense_mask=dense_mask)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    for case in CASES:
        _, length = packs_in_a_row(case)
        row = {
            "row": f"{length:,}-token row ({case.name})",
            "cpu_ms": host_ms(case, "cpu", True),
            "meta_ms": host_ms(case, "meta", True),
            "meta_no_dense_mask_ms": host_ms(case, "meta", False),
            "dense_mask_mb": length**2 / 1e6,
        }
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
