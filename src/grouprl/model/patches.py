"""The one place where grouprl changes something it does not own, and the context that undoes it.

grouprl's fast paths need two attention functions in transformers' attention registry: the packed
training pass (`model/packed_attention.py`, reached through "sdpa") and the engine's
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
forward (`forward.capture_head_input`); decode-step linear layers take the weight-major
product during one generate call (`cpu_products.weight_major_decode`).

What is deliberately not undone, and why:
- `GRPOConfig.keep_freed_host_memory=True` (off by default) raises glibc's malloc thresholds for the
  process (`reuse_freed_host_memory`, below) when the context is entered on a CPU model: glibc cannot
  report its previous thresholds, and setting any of them switches off its dynamic threshold for good,
  so the setting cannot be undone. It is made only when the user asks for it.
- `GRPOConfig.cast_lm_head_to_fp32=True` converts the LM head to fp32 at construction, as TRL does:
  the head's weight is fp32 from then on, so its fp32 forward must stay with it (`loading.py`).

glibc malloc, in detail. A CPU step allocates and frees tensors of the same few MB again and again:
each decode step's logits (8 x 151,936 floats on W3), sampling temporaries, each micro-batch's
activations. glibc serves allocations above its mmap threshold with a fresh mapping from the OS and
unmaps it on free, so every reuse pays one page fault per 4 KiB page when the memory is first touched.
Measured on this project's machine: one 128-token W3 generation took 685,750 minor page faults and
4.96-5.18 s; with the thresholds below, 3-158 faults and 3.25-3.66 s. A W4 training pass: 4.1-4.2 ->
3.8-3.9 s.

`reuse_freed_host_memory` raises glibc's mmap threshold to its maximum (32 MiB: larger blocks, like a
training chunk's 128 MiB of logits, still get their own mapping) and its trim threshold to 64 MiB
(the heap keeps up to that much free memory at its top instead of shrinking at once). Freed memory
then stays in the process for reuse; peak memory is unchanged. Without glibc (macOS, musl) it does
nothing.

`release_free_host_memory` is the other half, used by the training loop on a CPU model whether or not
the thresholds were raised: between each micro-batch's forward and its backward, glibc's malloc_trim hands
the free pages inside the heap back to the OS. The forward frees its temporaries in a different pattern
from the backward's, and a block left alive between them (a saved activation) pins the free memory around
it, so without it the heap kept up to 1.3 GiB free: W5 in bf16 (SmolLM2-135M, 3 steps) peaked at 4.5 GiB
resident with 1.9 GiB of live blocks. Within a phase freed blocks are still reused. A trim costs 30-110 ms
on that 2.5 GiB heap, and the pages handed back fault in again when reused (2-4 us a page on this
project's machines), so it runs only where the step's peak comes (backward) and only when at least 256 MiB
are free. Trimming also after generation and after each update, as first built, cost W5 about 1.5 s a step
in page faults (~800,000 a step) for a peak 0-7% lower.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from grouprl.model.packed_attention import sdpa_or_packed

logger = logging.get_logger("grouprl")

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


# --- glibc malloc: freed host memory kept for reuse, free heap released ---------------------------

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest accepted value on 64-bit systems
TRIM_THRESHOLD = 64 * 1024 * 1024


@functools.cache
def _libc_function(name: str):
    """The C library's function `name`, or None (not glibc, or a glibc without it)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def reuse_freed_host_memory() -> bool:
    """Set glibc's thresholds (module doc); True if they were set."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:  # not glibc
        logger.warning(
            "grouprl: keep_freed_host_memory=True, but this C library has no mallopt (not glibc): nothing was set."
        )
        return False
    applied = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if applied:
        logger.info(
            "grouprl: glibc keeps freed blocks up to 32 MiB for reuse for the rest of this process "
            "(keep_freed_host_memory=True)."
        )
    return applied


RELEASE_THRESHOLD = 256 * 1024 * 1024  # free heap bytes worth handing back (below: the re-faults cost more)


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def free_heap_bytes() -> int | None:
    """Bytes in free blocks of glibc's heap (resident or not); None without glibc >= 2.33."""
    mallinfo2 = _libc_function("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2().fordblks


def release_free_host_memory() -> None:
    """Return the free pages inside glibc's heap to the OS (malloc_trim; module doc) when at least
    RELEASE_THRESHOLD bytes are free. Nothing without glibc."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return
    free = free_heap_bytes()
    if free is None or free >= RELEASE_THRESHOLD:
        trim(0)
