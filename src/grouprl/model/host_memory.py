"""Let freed host memory be reused instead of returned to the OS (glibc malloc, CPU training).

A CPU step allocates and frees tensors of the same few MB again and again: each decode step's
logits (8 x 151,936 floats on W3), sampling temporaries, each micro-batch's activations. glibc
serves allocations above its mmap threshold with a fresh mapping from the OS and unmaps it on
free, so every reuse pays one page fault per 4 KiB page when the memory is first touched. Measured
on this project's machine: one 128-token W3 generation took 685,750 minor page faults and 4.96-5.18
s; with the thresholds below, 3-158 faults and 3.25-3.66 s. A W4 training pass: 4.1-4.2 -> 3.8-3.9 s.

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

It is a process-wide setting that cannot be undone (glibc reports no thresholds to restore, and
setting one switches off its dynamic mmap threshold for good), so grouprl makes it only when asked:
`GRPOConfig.keep_freed_host_memory=True`, applied by `patches.grouprl_patches()` on a CPU model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from transformers.utils import logging

logger = logging.get_logger("grouprl")

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
