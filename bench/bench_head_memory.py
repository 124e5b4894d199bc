"""Peak memory of the LM head's logprobs, forward and backward (model/forward.py `_LinearHeadLogprobs`), counted as
the bytes of live tensor storages the head's operators allocated: the same count on any device, no GPU needed.

    python bench/bench_head_memory.py                  # the Qwen2.5-0.5B head (151,936 x 896), fp32 under bf16
                                                       # autocast, 64 rows x 256 completion tokens
    python bench/bench_head_memory.py --vocab 49152 --width 576 --positions 8192 --precision fp32
    python bench/bench_head_memory.py --layers 4 --rows 16    # a whole training pass of the 0.5B shape's width,
                                                              # 4 of its layers, checkpointed as the trainer runs them

Prints the forward's and the backward's peaks and the five largest tensors alive at the backward's, as JSON. With
`--layers`, the whole pass (forward.completion_logprobs, rows of 48 prompt and 256 completion tokens), tied embeddings,
in each of `HEAD_CASTS`' ways (the trainer's, tied node; the cast alone before the body; autocast's cast in the head),
and for each the most bytes alive during the layers' backward (from the head's backward, the final norm's gradient,
to the first layer's input's gradient), after it (the embedding's and the tied weight's gradients) and in all.
`--precision fp32` or `bf16`: fp32 or bf16 weights without autocast (there the head makes no cast, so the last two
ways are one: autograd sums the tied weight's gradients).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LiveStorageBytes(TorchDispatchMode):
    """Bytes of the tensor storages that operators under this mode allocated and that are still alive, their peak,
    and what was alive at the peak (a storage's Python object lives as long as the storage, so a finalizer says when
    it is freed)."""

    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple[int, str, tuple, torch.dtype]] = {}  # data pointer -> bytes, operator, shape, dtype
        self.live = self.peak = 0
        self.at_peak: list[tuple[int, str, tuple, torch.dtype]] = []

    def _freed(self, key: int) -> None:
        self.live -= self.alive.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.alive:
                self.alive[key] = (storage.nbytes(), func.overloadpacket.__name__, tuple(t.shape), t.dtype)
                self.live += storage.nbytes()
                weakref.finalize(storage, self._freed, key)
                if self.live > self.peak:
                    self.peak, self.at_peak = self.live, list(self.alive.values())
        return out


PRECISIONS = ("autocast", "fp32", "bf16")  # fp32 weights under bf16 autocast; fp32 weights alone; bf16 weights alone


def head_peaks(vocab: int, width: int, positions: int, precision: str = "autocast") -> dict:
    """Peaks (bytes) of one forward and backward of a (vocab, width) head over `positions` hidden states, with the
    entropy, as the trainer's loss takes them, in `precision` (PRECISIONS)."""
    if importlib.util.find_spec("grouprl") is None:  # this checkout's, unless one is installed or on PYTHONPATH
        sys.path.insert(0, os.path.join(ROOT, "src"))
    from grouprl.model.logprobs import head_logprobs

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    head = torch.nn.Linear(width, vocab, bias=False, dtype=dtype)
    hidden = (torch.randn(1, positions, width, dtype=dtype) * 0.1).requires_grad_()
    tokens = torch.randint(0, vocab, (1, positions))
    counter = LiveStorageBytes()
    with counter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            logps, entropies = head_logprobs(hidden, head.forward, tokens, 1.0)
        forward = counter.peak
        (logps.sum() + entropies.sum()).backward()
    largest = sorted(counter.at_peak, key=lambda entry: -entry[0])[:5]
    return {
        "forward_peak_gb": round(forward / 1e9, 3),
        "backward_peak_gb": round(counter.peak / 1e9, 3),
        "alive_at_the_peak": [
            f"{op} {list(shape)} {str(dtype)[6:]}: {size / 1e9:.3f} GB" for size, op, shape, dtype in largest
        ],
    }


class Timeline(LiveStorageBytes):
    """LiveStorageBytes that also keeps (live bytes, operator) after every operator."""

    def __init__(self):
        super().__init__()
        self.steps: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.steps.append((self.live, func.overloadpacket.__name__))
        return out


HEAD_CASTS = ("tied node", "before the body", "in the head")


def pass_peaks(
    model: torch.nn.Module, batch: tuple, head_cast: str, autocast: bool = True
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Peaks (bytes) of one training pass of `model` (checkpointed by the caller) over `batch` (prompt ids and mask,
    completion ids and mask), under bf16 autocast on their device if `autocast`, in one forward (no length buckets),
    and the parameters' gradients. `head_cast` (HEAD_CASTS): "tied node" (as the trainer runs: the cast and, for
    tied embeddings, the lookup made by one node, forward.head_weight_and_inputs), "before the body" (the cast
    alone, product_weight: autograd sums a tied weight's two gradients) or "in the head" (autocast's cast, inside
    the head). The layers' backward runs from the head's (the final norm's gradient) to the first layer's input's."""
    from unittest.mock import patch

    if importlib.util.find_spec("grouprl") is None:
        sys.path.insert(0, os.path.join(ROOT, "src"))
    import grouprl.model.logprobs as logprobs
    from grouprl.model.forward import product_weight
    from grouprl.model.patches import grouprl_patches

    timeline, head_done = Timeline(), []
    model.model.norm.weight.register_post_accumulate_grad_hook(lambda p: head_done.append(len(timeline.steps)))
    layers_done: list[int] = []  # when the first layer's input has its gradient: the layers' backward is over

    def mark_first_layer_input(layer, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: layers_done.append(len(timeline.steps)))

    model.model.layers[0].register_forward_pre_hook(mark_first_layer_input, with_kwargs=True)
    replaced = {
        "before the body": lambda model, head, forwards, plain=(): (product_weight(head), forwards),
        "in the head": lambda model, head, forwards, plain=(): (None, forwards),
    }
    way = patch.object(logprobs, "head_weight_and_inputs", replaced[head_cast]) if head_cast in replaced else None
    with way or contextlib.nullcontext(), grouprl_patches(), timeline:
        with torch.autocast(batch[0].device.type, dtype=torch.bfloat16, enabled=autocast):
            out = logprobs.completion_logprobs(model, *batch, temperature=1.0, bucket_by_length=False)
        forward = timeline.peak
        (out.logprobs * batch[3]).sum().backward()
    layers_end = min(i for i in layers_done if i > head_done[0])
    peaks = {
        "head_cast": head_cast,
        "forward_peak": forward,
        "layers_backward_peak": max(live for live, _ in timeline.steps[head_done[0] : layers_end]),
        "backward_end_peak": max(live for live, _ in timeline.steps[layers_end:]),
        "pass_peak": timeline.peak,
    }
    return peaks, {name: p.grad for name, p in model.named_parameters()}


def wide_pass(vocab: int, width: int, layers: int, rows: int, head_cast: str, precision: str = "autocast") -> dict:
    """`pass_peaks` (GB) of the 0.5B shape's layers at `width`, tied embeddings, checkpointed, over `rows` rows of 48
    prompt and 256 completion tokens, in `precision` (PRECISIONS)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=width, intermediate_size=4864 * width // 896, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (rows, 48), generator=generator)
    completions = torch.randint(0, vocab, (rows, 256), generator=generator)
    batch = (prompts, torch.ones_like(prompts), completions, torch.ones_like(completions))
    peaks, _ = pass_peaks(model, batch, head_cast, autocast=precision == "autocast")
    return {
        "precision": precision,
        "head_cast": head_cast,
        **{f"{name}_gb": round(peaks[name] / 1e9, 3) for name in peaks if name != "head_cast"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--width", type=int, default=896)
    parser.add_argument("--positions", type=int, default=64 * 256)
    parser.add_argument("--layers", type=int, help="a whole training pass with this many layers (module doc)")
    parser.add_argument("--rows", type=int, default=16, help="with --layers: rows of 48 + 256 tokens")
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="autocast",
        help="fp32 weights under bf16 autocast (the trainer's bf16=True, the default), fp32 alone, or bf16 weights",
    )  # fmt: skip
    args = parser.parse_args()
    if args.layers:
        for cast in HEAD_CASTS:
            print(
                json.dumps(wide_pass(args.vocab, args.width, args.layers, args.rows, cast, args.precision)), flush=True
            )
        return
    print(json.dumps({**vars(args), **head_peaks(args.vocab, args.width, args.positions, args.precision)}, indent=1))


if __name__ == "__main__":
    main()
