"""The captured loop's decode step alone, as the trainer generates (fp32 weights under bf16 autocast) or from bf16
weights, in each way the step can be computed: what one step costs and how many kernels it launches, without a
training run or TRL. On CUDA the step replays a CUDA graph, as in training; elsewhere it runs eagerly (a dry run).

    python bench/bench_decode_step.py                             # the 0.5B shape, 8 prompts x 8, 48-token prompts,
                                                                  # 256 new tokens, fp32 weights under bf16 autocast
    python bench/bench_decode_step.py --dtype bf16 --ways as-is,compiled
    python bench/bench_decode_step.py --shape tiny --device cpu   # a dry run of the same code

The ways:
  as-is           `generation_engine="captured"` with this checkout's defaults
  mlp-row-major   a stacked gate/up product as x @ W^T, its halves strided (the step before W @ x^T became CUDA's
                  default, fused_step.mlp_transposed_pays_off)
  compiled        `compile_decode_step=True`: the step compiled by inductor before it is captured (its first call,
                  the compile, is the untimed warm-up)
Random weights, built here, never emit an EOS: every row decodes every step. Each way: one untimed generate call,
then one timed; prints one JSON line per way: decode-loop ms per step (`CapturedGenerator.last_decode`), kernels a
step (bench/gpu/bench_generation.py's count: CUDA kernels, or aten operators on a CPU), the call's peak GPU memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from unittest.mock import patch

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))
from bench_generation import SHAPES, kernels_per_step  # noqa: E402

from grouprl.core.types import SamplingParams  # noqa: E402
from grouprl.generation import fused_step  # noqa: E402
from grouprl.generation.static_decode import CapturedGenerator  # noqa: E402

WAYS = ("as-is", "mlp-row-major", "compiled")


class NoText:
    """The generator decodes each completion's text; the step's cost does not depend on it."""

    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def build_model(shape_name: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = SHAPES[shape_name]
    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=True, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def one_way(way: str, model, prompts: list[list[int]], generations: int, params: SamplingParams, device: str) -> dict:
    backend = CapturedGenerator(model, NoText(), [], 0, compile_step=way == "compiled")
    row_major = patch.object(fused_step, "mlp_transposed_pays_off", lambda device: False)
    with row_major if way == "mlp-row-major" else contextlib.nullcontext():
        backend.generate(prompts, generations, params)  # warm-up: libraries' lazy set-up, the compile if any
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        backend.generate(prompts, generations, params)
        steps, seconds = backend.last_decode
        peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
        # counted on uncaptured steps, slow where eager: 32 of them do, except for the compiled step, whose cache
        # shape (prompt + new tokens) must stay the compiled one's
        counted = (
            params if way == "compiled" else dataclasses.replace(params, max_new_tokens=min(32, params.max_new_tokens))
        )
        kernels = kernels_per_step(backend, prompts, generations, counted, device)
    return {
        "way": way,
        "decode_ms_per_step": round(1000 * seconds / max(steps, 1), 3),
        "decode_steps": steps,
        "kernels_per_step": round(kernels, 1),
        **({"peak_gpu_memory_gb": round(peak, 3)} if peak is not None else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5B")
    parser.add_argument("--dtype", choices=["fp32-autocast", "bf16"], default="fp32-autocast")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"of {', '.join(WAYS)}")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    ways = args.ways.split(",")
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"--ways: unknown {sorted(unknown)}; choose from {', '.join(WAYS)}")
    autocast = args.dtype == "fp32-autocast"
    model = build_model(args.shape, torch.float32 if autocast else torch.bfloat16, args.device)
    generator = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape].vocab
    prompts = torch.randint(1, vocab, (args.prompts, args.prompt_tokens), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    print(
        json.dumps(
            {"shape": args.shape, "dtype": args.dtype, "device": args.device, "rows": len(prompts) * args.generations}
        )
    )
    for way in ways:
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=autocast):
            print(json.dumps(one_way(way, model, prompts, args.generations, params, args.device)), flush=True)


if __name__ == "__main__":
    main()
