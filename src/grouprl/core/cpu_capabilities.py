"""What this CPU and this torch build can run, asked once per process, so each CPU fast path can choose.

Two questions decide grouprl's CPU paths:

- Are bf16 products native here? Only with bf16 units (AVX512-BF16, AMX-BF16, ARM BF16) that oneDNN, which
  runs PyTorch's bf16 CPU products, may use. Without them bf16 is emulated: ~100x slower matrix products
  than fp32 on an AVX2 machine, so grouprl trains in fp32 unless bf16 is asked for by name.
- Does oneDNN run bf16 at all (`torch.ops.mkldnn._is_mkldnn_bf16_supported`)? It needs AVX512BW/VL/DQ or
  AVX-NE-CONVERT; without them its bf16 entry points, such as the packed decode weights, raise
  "bf16 path needs the cpu support ...".

Both honour the instruction-set limits a user (or CI) can set, which make a larger CPU run the code paths
of an AVX2-only one: ATEN_CPU_CAPABILITY (PyTorch's own kernels), ONEDNN_MAX_CPU_ISA (oneDNN's; torch's
bf16 check follows it) and MKL_ENABLE_INSTRUCTIONS (MKL's). `summary()` is the one line grouprl logs at the
start of a CPU run (log_level="info").
"""

from __future__ import annotations

import functools
import os
import platform

import torch

# Environment variables that hold a library's kernels to a smaller instruction set than the CPU has.
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
BF16_UNIT_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo names (x86, x86, ARM)
# ONEDNN_MAX_CPU_ISA values whose instruction set includes bf16 dot products (oneDNN's names).
_ONEDNN_ISAS_WITH_BF16 = ("BF16", "AMX", "AVX10", "DEFAULT", "ALL")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_limits() -> dict[str, str]:
    """The instruction-set limits set in this environment (ISA_LIMITS), by variable."""
    return {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)}


def _onednn_limit_allows_bf16() -> bool:
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return not limit or any(name in limit for name in _ONEDNN_ISAS_WITH_BF16)


@functools.cache
def onednn_runs_bf16() -> bool:
    """Whether oneDNN in this torch build runs bf16 products on this CPU under the limits in force."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if not torch.backends.mkldnn.is_available() or check is None:
        return False
    return bool(check())


@functools.cache
def bf16_emulation_reason() -> str | None:
    """Why bf16 products are emulated on this CPU (module doc), or None where they run natively. Off Linux,
    where no flags can be read, the configuration is trusted (None)."""
    flags = cpu_flags()
    if not flags and platform.system() != "Linux":
        return None
    if not any(flag in flags for flag in BF16_UNIT_FLAGS):
        return "this CPU has no bf16 units (no AVX512-BF16/AMX)"
    if not _onednn_limit_allows_bf16():
        return f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} holds oneDNN below this CPU's bf16 units"
    if not onednn_runs_bf16():
        return "oneDNN in this torch build does not run bf16 products here"
    return None


def native_bf16() -> bool:
    """Whether bf16 products run natively on this CPU (module doc)."""
    return bf16_emulation_reason() is None


def summary() -> str:
    """One line: the CPU features that choose grouprl's CPU paths, and the limits in force."""
    flags = cpu_flags()
    shown = [
        f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16") if f in flags
    ]
    limits = ", ".join(f"{k}={v}" for k, v in isa_limits().items()) or "none"
    return (
        f"CPU {platform.machine()} flags [{' '.join(shown) or 'unknown'}], ATen kernels "
        f"{torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 {'yes' if onednn_runs_bf16() else 'no'}, "
        f"bf16 products {'native' if native_bf16() else 'emulated'}; instruction-set limits: {limits}"
    )
