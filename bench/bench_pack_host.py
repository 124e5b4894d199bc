"""Host time to build one row of packed sequences (model/prompt_packing.build_pack), as the training pass builds it
for the GPU benchmark's cases (bench/gpu): 8 completions of 256 tokens behind each 48-token prompt, 3 packs in a
6,288-token row (the 0.5B case), and one pack of 1,024-token completions, 8,240 tokens (the 1.5B case).

    python bench/bench_pack_host.py

`cpu`: every tensor on the host, what building the dense (L, L) mask there and copying it cost before the masks
were made on the model's device; `meta`: the device's work takes no time, so what is left is the host's part when
the model is on a GPU; `meta, no dense mask`: a pack for packed attention (`dense_mask=False`). Median of 5.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from grouprl.model.prompt_packing import build_pack

CASES = {"6,288-token row (0.5B case)": (3, 256), "8,240-token row (1.5B case)": (1, 1024)}


def host_ms(packs: int, completion: int, device: str, dense_mask: bool) -> float:
    prompts, completions = [list(range(48))] * packs, [[list(range(completion))] * 8] * packs
    times = []
    for _ in range(6):
        started = time.perf_counter()
        build_pack(prompts, completions, completion, torch.device(device), concatenate=True, dense_mask=dense_mask)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    for name, (packs, completion) in CASES.items():
        row = {
            "row": name,
            "cpu_ms": host_ms(packs, completion, "cpu", True),
            "meta_ms": host_ms(packs, completion, "meta", True),
            "meta_no_dense_mask_ms": host_ms(packs, completion, "meta", False),
            "dense_mask_mb": (48 + 8 * completion) ** 2 * packs**2 / 1e6,
        }
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
