"""Long completions through the captured decode loop: a Llama-3.1-8B shape (random bf16 weights, built on the device),
128 rows (16 prompts x 8) of 256 prompt tokens and 8,192 new tokens with no EOS, so every row runs to the end. Its
static cache for all rows at once (~142 GB) does not fit one H200: the loop decodes in waves sized to the free
memory (static_decode.py). Prints and writes one JSON record: the waves, seconds, decode ms a step, the peak, and
whether every row has all its tokens.

    python bench/gpu/long_completions.py                 # on a GPU (~5 min on an H200: 2-3 waves of 8,191 steps)
    python bench/gpu/long_completions.py --tiny          # the same call at tiny shapes, on any device (a dry run)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if importlib.util.find_spec("grouprl") is None:  # this checkout's, unless one is installed or on PYTHONPATH
    sys.path.insert(0, os.path.join(ROOT, "src"))

LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
LLAMA_8B.update(intermediate_size=14336, vocab_size=128_256, rope_theta=500_000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY.update(intermediate_size=128, vocab_size=512)


class WordTokenizer:
    """What CapturedGenerator asks of a tokenizer (decode), for random token ids."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and a small memory budget (a dry run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=8192)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "long_completions.json"))
    args = parser.parse_args()

    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from grouprl.core.types import SamplingParams
    from grouprl.generation import static_decode
    from grouprl.generation.static_decode import CapturedGenerator

    sizes = TINY if args.tiny else LLAMA_8B
    new_tokens = 96 if args.tiny else args.new_tokens
    positions = args.prompt_tokens + new_tokens + 64
    config = LlamaConfig(**sizes, max_position_embeddings=positions, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    started = time.perf_counter()
    torch.set_default_dtype(dtype)  # initialised in bf16 on a GPU: no fp32 copy of 8B parameters
    with torch.device(args.device):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    built_s = time.perf_counter() - started
    vocab = sizes["vocab_size"]
    prompts = torch.randint(vocab, (args.prompts, args.prompt_tokens)).tolist()
    sampler = CapturedGenerator(
        model,
        WordTokenizer(),
        eos_token_ids=[],
        pad_token_id=0,
        compile_step=False,
        memory_budget=8 * 2**20 if args.tiny else None,  # the tiny call in waves too
    )
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("grouprl").addHandler(handler)
    logging.getLogger("grouprl").setLevel(logging.INFO)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        free_before = static_decode.free_memory(torch.device("cuda"))
    started = time.perf_counter()
    completions = sampler.generate(prompts, args.generations, SamplingParams(max_new_tokens=new_tokens))
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    steps, decode_s = sampler.last_decode
    result = {
        "shape": "tiny" if args.tiny else "llama-3.1-8B",
        "rows": len(completions),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": new_tokens,
        "every_row_complete": all(len(c.token_ids) == new_tokens for c in completions),
        "generation_s": seconds,
        "decode_steps": steps,
        "decode_ms_per_step": 1000 * decode_s / max(steps, 1),
        "model_build_s": built_s,
        "wave_log": [r for r in records if "wave" in r],
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if args.device == "cuda":
        result["free_gb_before"] = free_before / 2**30
        result["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
