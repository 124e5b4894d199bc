"""The aten operators one training pass (forward + backward of the policy's logprobs) dispatches, and the model
forwards it makes: on a GPU each operator is a kernel launched from the host, so where the kernels are short (the
0.5B case) the count, not the arithmetic, sets the pass's time.

    python bench/bench_train_ops.py                 # the GPU benchmark's first case: 8 prompts x 8 completions,
                                                    # 48-token prompts, 256 new tokens, the 0.5B shape's 24 layers
    python bench/bench_train_ops.py --new-tokens 64 --layers 2

The 0.5B shape's layers and heads (14 / 2) at a tiny width, with gradient checkpointing on, as the benchmark trains:
the count does not depend on the width, and the head's chunking is held at the real vocabulary's (151,936 tokens:
256 positions a chunk). Three passes of the same rows:
  packed  grouprl's completion_logprobs with each prompt's rows packed (prompt_packing.py), as on a CPU: this case's
          estimated saving (14%) is under what a GPU needs (`worth_packing`)
  plain   grouprl's completion_logprobs, every row on its own (a GPU's pass here, and pack_shared_prompts=False)
  naive   one forward of all rows with full logits, log_softmax and a gather (what TRL 1.16 does)
Views, which launch nothing, are not counted. Prints JSON: per pass, forward and backward operators, model
forwards (layer recomputations by checkpointing included), CPU seconds (tiny width: mostly host work), and the
operators that make a GPU wait for the host (`SYNCING`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))
from bench_decode_ops import VIEWS  # noqa: E402
from bench_generation import PLAN, SHAPES  # noqa: E402  (the GPU benchmark's shapes and cases)

# operators whose result the host reads (a CUDA stream sync each): scalars, data-dependent shapes
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero", "item"}


class CountOperators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def build_model(layers: int, vocab: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = SHAPES["0.5B"]
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=2 * shape.heads * 4, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, tie_word_embeddings=True,
        max_position_embeddings=4096, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def batch(prompts: int, generations: int, prompt_tokens: int, new_tokens: int, vocab: int):
    generator = torch.Generator().manual_seed(1)
    rows = prompts * generations
    prompt_ids = torch.randint(0, vocab, (prompts, prompt_tokens), generator=generator).repeat_interleave(
        generations, 0
    )
    completion_ids = torch.randint(0, vocab, (rows, new_tokens), generator=generator)
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids)


def naive_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=completion_ids.shape[1] + 1).logits[:, :-1]
    return logits.float().log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def one_pass(name: str, model, inputs) -> dict:
    from grouprl.model import forward as forward_module
    from grouprl.model import prompt_packing
    from grouprl.model.logprobs import completion_logprobs
    from grouprl.model.patches import grouprl_patches

    forwards = [0]
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *_: forwards.__setitem__(0, forwards[0] + 1)
    )
    chunk_elements, worth_packing = forward_module.CHUNK_ELEMENTS, prompt_packing.worth_packing
    prompt_packing.worth_packing = lambda *args: name == "packed"
    # the real vocabulary's chunking (256 positions) with this model's small one
    forward_module.CHUNK_ELEMENTS = forward_module.positions_per_chunk(SHAPES["0.5B"].vocab) * model.config.vocab_size
    try:
        with grouprl_patches():
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            with CountOperators() as forward_ops:
                if name == "naive":
                    logps = naive_logprobs(model, *inputs)
                else:
                    logps = completion_logprobs(model, *inputs, temperature=1.0, with_entropy=True).logprobs
                loss = (logps * inputs[3]).sum() / inputs[3].sum()
            forward_calls = forwards[0]
            with CountOperators() as backward_ops:
                loss.backward()
            seconds = time.perf_counter() - started
    finally:
        forward_module.CHUNK_ELEMENTS, prompt_packing.worth_packing = chunk_elements, worth_packing
        hook.remove()
    both = forward_ops.counts + backward_ops.counts
    return {
        "forward_operators": sum(forward_ops.counts.values()),
        "backward_operators": sum(backward_ops.counts.values()),
        "model_forwards": forward_calls,
        "layer_recomputations": forwards[0] - forward_calls,
        "syncing_operators": {k: v for k, v in both.items() if k in SYNCING},
        "cpu_seconds": round(seconds, 3),
        "top_operators": dict(both.most_common(12)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    case = PLAN[0]
    parser.add_argument("--layers", type=int, default=SHAPES[case.shape].layers)
    parser.add_argument("--new-tokens", type=int, default=case.new_tokens)
    parser.add_argument("--passes", default="packed,plain,naive")
    args = parser.parse_args()
    vocab = 512
    model = build_model(args.layers, vocab)
    inputs = batch(case.prompts, case.generations, case.prompt_tokens, args.new_tokens, vocab)
    one_pass("packed", model, inputs)  # warm-up: the packing probe runs once per model
    results = {name: one_pass(name, model, inputs) for name in args.passes.split(",")}
    print(json.dumps({"case": case.name, "layers": args.layers, "new_tokens": args.new_tokens, **results}, indent=1))


if __name__ == "__main__":
    main()
