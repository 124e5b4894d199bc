"""The one place where grouprl changes something it does not own, and the context that undoes it.

grouprl's fast paths need two attention functions in transformers' attention registry: the packed
training pass (`algorithms/packed_attention.py`, reached through "sdpa") and the engine's
shared-prefix decode (`generation/shared_prefix.py`, under its own name). Both are installed only
inside `grouprl_patches()`, which `GRPOTrainer.train()`, `evaluate()`, the fast generation engine
and the fast paths themselves enter, and removed when the outermost one exits:

- They go into the *instance* mapping of transformers' shared `ALL_ATTENTION_FUNCTIONS` (its public
  `__setitem__` / `__delitem__`), which models consult before the class-wide mapping that
  `AttentionInterface.register` writes. That class-wide mapping is never touched, and on exit the
  instance mapping holds exactly what it held before (an entry the user had put there is restored).
- The context is re-entrant and counts its depth (a lock guards it: generation may run in another
  thread), so nested entries (train() -> a generation -> a logprob pass) cost nothing and only the
  outermost exit restores.

Model changes are scoped where they are made, each undone in its own `finally`: the shared-prefix
decode sets the model's attention implementation with `model.set_attn_implementation` for the
decode loop and sets it back (`shared_prefix.decoding`); the head records its input during one
forward (`model_forward.capture_head_input`); decode-step linear layers take the weight-major
product during one generate call (`decode_products.weight_major_decode`).

What is deliberately not undone, and why:
- `GRPOConfig.keep_freed_host_memory=True` (off by default) raises glibc's malloc thresholds for the
  process (`host_memory.py`) when the context is entered on a CPU model: glibc cannot report its
  previous thresholds, and setting any of them switches off its dynamic threshold for good, so the
  setting cannot be undone. It is made only when the user asks for it.
- `GRPOConfig.cast_lm_head_to_fp32=True` converts the LM head to fp32 at construction, as TRL does:
  the head's weight is fp32 from then on, so its fp32 forward must stay with it (models.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from grouprl.model.host_memory import reuse_freed_host_memory
from grouprl.model.packed_attention import sdpa_or_packed

# Attention functions installed while the context is active: name -> function. "sdpa" passes every
# call through to the function it replaces unless the call carries a pack layout.
_ATTENTION: dict[str, Callable] = {"sdpa": sdpa_or_packed}
_lock = threading.RLock()
_depth = 0
_replaced: dict[str, Callable | None] = {}  # name -> the instance-mapping entry we displaced (None: there was none)


def scoped_attention(name: str, function: Callable) -> None:
    """Declare an attention function that `grouprl_patches()` installs under `name` while active.

    Declaring changes nothing in transformers; if a context is active already, the function is
    installed now and removed with the others when the outermost context exits.
    """
    with _lock:
        _ATTENTION[name] = function
        if _depth > 0 and name not in _replaced:
            _install(name)


def patches_active() -> bool:
    return _depth > 0


@contextlib.contextmanager
def grouprl_patches(model: torch.nn.Module | None = None, config: Any = None) -> Iterator[None]:
    """Within the block, grouprl's attention functions are registered (module doc); undone on exit.

    `config` (a GRPOConfig, optional) carries the opt-in process setting `keep_freed_host_memory`,
    applied when `model` is on the CPU.
    """
    global _depth
    with _lock:
        if _depth == 0:
            for name in _ATTENTION:
                _install(name)
        _depth += 1
    try:
        if config is not None and getattr(config, "keep_freed_host_memory", False) and _on_cpu(model):
            reuse_freed_host_memory()
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name in list(_replaced):
                    _uninstall(name)


def _install(name: str) -> None:
    _replaced[name] = _local_entry(name)
    ALL_ATTENTION_FUNCTIONS[name] = _ATTENTION[name]


def _uninstall(name: str) -> None:
    previous = _replaced.pop(name)
    if previous is None:
        del ALL_ATTENTION_FUNCTIONS[name]  # removes the instance entry only; the class-wide one shows through again
    else:
        ALL_ATTENTION_FUNCTIONS[name] = previous


def _local_entry(name: str) -> Callable | None:
    """The entry the instance mapping itself holds for `name` (not the class-wide one), or None.

    transformers has no public accessor that tells the two apart (`[]` reads the instance entry
    first, then the class-wide one), so its instance dict is read here, never written.
    """
    return ALL_ATTENTION_FUNCTIONS._local_mapping.get(name)


def _on_cpu(model: torch.nn.Module | None) -> bool:
    if model is None:
        return False
    parameter = next(iter(model.parameters()), None)
    return parameter is not None and parameter.device.type == "cpu"
