"""The aten operators one decode step of the captured loop dispatches (generation/static_decode.py): on a GPU each
is a kernel a replayed graph runs one after another, so their count is the step's cost at small batch sizes.

    python bench/bench_decode_ops.py                       # the Qwen2.5-0.5B shape, 24 layers, bf16, 64 rows
    python bench/bench_decode_ops.py --layers 2 --dtype fp32
    python bench/bench_decode_ops.py --dtype fp32-autocast  # fp32 weights under bf16 autocast, as the GPU benchmark
    PYTHONPATH=/path/to/other/checkout/src python bench/bench_decode_ops.py   # another version, same count

Random weights, built here. On a CPU the bf16 products are left unpacked (`F.linear`, as on CUDA), so the count is
the one a GPU step dispatches, except `F.rms_norm`: one fused kernel on CUDA, eight operators on a CPU. Views,
which launch nothing, are not counted. Prints the total, the count per layer and per operator, as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
from bench_generation import SHAPES  # noqa: E402  (the GPU benchmark's model shapes)

VIEWS = {
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "t", "transpose",
    "permute", "alias", "split", "chunk", "as_strided", "detach", "split_with_sizes", "unbind", "_reshape_alias",
    "lift_fresh", "empty", "empty_strided", "zeros_like", "new_empty",
}  # fmt: skip


class CountOperators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def step_operators(
    layers: int, dtype: torch.dtype, rows: int, device: str, autocast: bool = False, shape: str = "0.5B"
) -> Counter:
    """Operators of the third decode step of one generation (rows = 8 prompts x rows / 8 samples); `autocast`:
    under bf16 autocast, as the trainer generates with `bf16=True`; `shape`: one of the GPU benchmark's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grouprl.core.types import SamplingParams
    from grouprl.generation import fused_step, static_decode

    shape = SHAPES[shape]
    eos, pad = shape.vocab - 1, shape.vocab - 2
    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=True, max_position_embeddings=4096, eos_token_id=eos, pad_token_id=pad,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()
    counted: list[Counter] = []
    step = static_decode.DecodeLoop.step

    def counting_step(loop) -> None:
        with CountOperators() as mode:
            step(loop)
        counted.append(mode.counts)

    tokenizer = type("Tokenizer", (), {"decode": lambda self, ids, **kwargs: ""})()
    generator = static_decode.CapturedGenerator(model, tokenizer, [eos], pad, capture=False)
    packs = fused_step.packs_weights
    static_decode.DecodeLoop.step, fused_step.packs_weights = counting_step, lambda *args: False
    try:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            generator.generate([[1, 2, 3, 4, 5]] * 8, rows // 8, SamplingParams(max_new_tokens=4, temperature=1.0))
    finally:
        static_decode.DecodeLoop.step, fused_step.packs_weights = step, packs
    return counted[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32", "fp32-autocast"], default="bf16",
        help="the weights' dtype; fp32-autocast: fp32 weights under bf16 autocast (the GPU benchmark's bf16=True)",
    )  # fmt: skip
    parser.add_argument("--rows", type=int, default=64, help="a multiple of 8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    autocast = args.dtype == "fp32-autocast"
    counts = step_operators(args.layers, dtype, args.rows, args.device, autocast)
    one_layer = step_operators(1, dtype, args.rows, args.device, autocast)
    two_layers = step_operators(2, dtype, args.rows, args.device, autocast)
    per_layer = sum(two_layers.values()) - sum(one_layer.values())
    print(
        json.dumps(
            {
                "layers": args.layers,
                "dtype": args.dtype,
                "rows": args.rows,
                "device": args.device,
                "operators_per_step": sum(counts.values()),
                "operators_per_layer": per_layer,
                "outside_the_layers": sum(one_layer.values()) - per_layer,
                "by_operator": dict(counts.most_common()),
            }
        )
    )


if __name__ == "__main__":
    main()
