"""The aten operators one training pass (forward + backward of the policy's logprobs) dispatches, the model forwards
it makes, and on a GPU its time: each operator is a kernel launched from the host, so where the kernels are short (the
0.5B case) the count, not the arithmetic, can set the pass's time.

    python bench/bench_train_ops.py                 # the GPU benchmark's first case (8 prompts x 8 completions,
                                                    # 48-token prompts, 256 new tokens), the 0.5B shape's 24 layers
    python bench/bench_train_ops.py --cases 2 --new-tokens 64 --layers 2
    python bench/bench_train_ops.py --width real --device cuda --cases 1,2 --repeat 3   # + seconds per pass (a GPU)
    python bench/bench_train_ops.py --cases 2 --row-tokens 8192    # + the packs in rows of up to 8,192 tokens
    python bench/bench_train_ops.py --cases 2 --explicit-products  # + packed attention by explicit products

The 0.5B shape's layers and heads (14 / 2) in bf16, at a tiny width (the default: the count does not depend on the
width, and the head's chunking is held at the real vocabulary's, 256 positions a chunk) or the real one, gradient
checkpointing on, as the benchmark trains; packed attention takes its GPU path (sdpa's kernel) on a CPU too, and
packs' rows their device's cap (`prompt_packing.row_token_cap`).
Three passes of the same rows:
  packed  grouprl's completion_logprobs with each prompt's rows packed (prompt_packing.py), whatever the estimate
  plain   grouprl's completion_logprobs, every row on its own (pack_shared_prompts=False)
  naive   one forward of all rows with full logits, log_softmax and a gather (what TRL 1.16 does)
Which of packed and plain the trainer runs is `prompt_packing.worth_packing`'s estimate. Views, which launch nothing,
are not counted. Prints JSON: per pass, forward and backward operators, model forwards (and layer recomputations by
checkpointing), the operators that make a GPU wait for the host (`SYNCING`), the counted run's seconds, with
--repeat the median seconds of that many uncounted runs, and on a GPU the pass's peak memory (weights and gradients
included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from unittest.mock import patch

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))
from bench_decode_ops import CountOperators  # noqa: E402  (aten operators by name, views left out)
from bench_generation import PLAN, SHAPES  # noqa: E402  (the GPU benchmark's shapes and cases)

# operators whose result the host reads (a CUDA stream sync each): scalars, data-dependent shapes
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero", "item"}


TINY_VOCAB = 512


def build_model(layers: int, width: str = "tiny", device: str = "cpu") -> torch.nn.Module:
    """The 0.5B shape with `layers` layers in bf16, at a tiny width or the real one."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = SHAPES["0.5B"]
    real = width == "real"
    config = Qwen2Config(
        vocab_size=shape.vocab if real else TINY_VOCAB, hidden_size=shape.hidden if real else 2 * shape.heads * 4,
        intermediate_size=shape.intermediate if real else 64, num_hidden_layers=layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, tie_word_embeddings=True,
        max_position_embeddings=4096, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def batch(case, new_tokens: int, vocab: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """The case's rows: its prompts (a shared prefix, if any, and own tokens) each with `generations` completions."""
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(0, vocab, (case.shared_prefix,), generator=generator)
    own = torch.randint(0, vocab, (case.prompts, case.prompt_tokens), generator=generator)
    prompt_ids = torch.cat([shared.expand(case.prompts, -1), own], 1).repeat_interleave(case.generations, 0)
    completion_ids = torch.randint(0, vocab, (case.prompts * case.generations, new_tokens), generator=generator)
    rows = prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids)
    return tuple(t.to(device) for t in rows)


def naive_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=completion_ids.shape[1] + 1).logits[:, :-1]
    return logits.float().log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def one_pass(
    name: str, model, inputs, repeat: int = 0, row_tokens: int | None = None, explicit_products: bool = False
) -> dict:
    """`name`: packed, plain or naive (module doc); `row_tokens`: packs' row cap for this pass (default
    prompt_packing.row_token_cap's); `explicit_products`: packed attention by explicit products (its path on a CPU
    with native bf16, for layers that checkpointing recomputes) or by sdpa's kernel (its path on a GPU)."""
    from grouprl.model import forward as forward_module
    from grouprl.model import packed_attention, prompt_packing
    from grouprl.model.logprobs import completion_logprobs
    from grouprl.model.patches import grouprl_patches

    forwards = [0]
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *_: forwards.__setitem__(0, forwards[0] + 1)
    )
    on_gpu = inputs[0].device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_gpu else lambda: None

    def loss() -> torch.Tensor:
        if name == "naive":
            logps = naive_logprobs(model, *inputs)
        else:
            logps = completion_logprobs(model, *inputs, temperature=1.0, with_entropy=True).logprobs
        return (logps * inputs[3]).sum() / inputs[3].sum()

    default_cap = prompt_packing.row_token_cap
    with contextlib.ExitStack() as patches:
        for target, attribute, replacement in (
            (prompt_packing, "worth_packing", lambda *args: name == "packed"),
            (prompt_packing, "row_token_cap", lambda device, cap=default_cap: row_tokens or cap(device)),
            # by default sdpa's kernel, as on a GPU
            (packed_attention, "_explicit_products_pay_off", lambda query: explicit_products),
            # the real vocabulary's chunking (256 positions) with a small one
            (
                forward_module,
                "CHUNK_ELEMENTS",
                forward_module.positions_per_chunk(SHAPES["0.5B"].vocab) * model.config.vocab_size,
            ),
        ):
            patches.enter_context(patch.object(target, attribute, replacement))
        patches.callback(hook.remove)
        patches.enter_context(grouprl_patches())
        model.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        synchronize()
        started = time.perf_counter()
        with CountOperators() as forward_ops:
            value = loss()
        forward_calls = forwards[0]
        with CountOperators() as backward_ops:
            value.backward()
        synchronize()
        seconds, recomputed = time.perf_counter() - started, forwards[0] - forward_calls
        timed = []
        for _ in range(repeat):
            model.zero_grad(set_to_none=True)
            synchronize()
            started = time.perf_counter()
            loss().backward()
            synchronize()
            timed.append(time.perf_counter() - started)
    both = forward_ops.counts + backward_ops.counts
    return {
        "forward_operators": sum(forward_ops.counts.values()),
        "backward_operators": sum(backward_ops.counts.values()),
        "model_forwards": forward_calls,
        "layer_recomputations": recomputed,
        "syncing_operators": {k: v for k, v in both.items() if k in SYNCING},
        "counted_run_seconds": round(seconds, 3),
        **({"median_seconds": round(sorted(timed)[len(timed) // 2], 4)} if timed else {}),
        **({"peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)} if on_gpu else {}),
        "top_operators": dict(both.most_common(12)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1", help="of bench/gpu/bench_generation.py's PLAN: 1, 2 or 1,2")
    parser.add_argument("--layers", type=int, default=SHAPES["0.5B"].layers)
    parser.add_argument("--new-tokens", type=int, help="default: the case's")
    parser.add_argument("--passes", default="packed,plain,naive")
    parser.add_argument("--width", choices=["tiny", "real"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=0, help="uncounted runs timed after the counted one")
    parser.add_argument(
        "--row-tokens", default="", help="packed passes again with these row caps (e.g. 32768: one row of all packs)"
    )
    parser.add_argument(
        "--explicit-products", action="store_true", help="the packed pass again, its attention by explicit products"
    )
    args = parser.parse_args()
    model = build_model(args.layers, args.width, args.device)
    for number in args.cases.split(","):
        case = PLAN[int(number) - 1]
        new_tokens = args.new_tokens or case.new_tokens
        inputs = batch(case, new_tokens, model.config.vocab_size, args.device)
        one_pass("packed", model, inputs)  # warm-up (the packing probe runs once per model)
        results = {name: one_pass(name, model, inputs, args.repeat) for name in args.passes.split(",")}
        for cap in filter(None, args.row_tokens.split(",")):
            results[f"packed, rows of {cap} tokens"] = one_pass("packed", model, inputs, args.repeat, int(cap))
        if args.explicit_products:
            results["packed, explicit products"] = one_pass(
                "packed", model, inputs, args.repeat, explicit_products=True
            )
        print(json.dumps({"case": case.name, "layers": args.layers, "new_tokens": new_tokens, **results}, indent=1))


if __name__ == "__main__":
    main()
