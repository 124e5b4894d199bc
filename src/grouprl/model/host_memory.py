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

It is a process-wide setting that cannot be undone (glibc reports no thresholds to restore, and
setting one switches off its dynamic mmap threshold for good), so grouprl makes it only when asked:
`GRPOConfig.keep_freed_host_memory=True`, applied by `patches.grouprl_patches()` on a CPU model.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from transformers.utils import logging

logger = logging.get_logger("grouprl")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest accepted value on 64-bit systems
TRIM_THRESHOLD = 64 * 1024 * 1024


def reuse_freed_host_memory() -> bool:
    """Set glibc's thresholds (module doc); True if they were set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
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
