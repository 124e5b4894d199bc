"""glibc malloc thresholds: freed blocks are reused instead of page-faulted in again."""

import resource

import pytest
import torch

from grouprl.host_memory import reuse_freed_host_memory


def _faults_of_repeated_allocations() -> int:
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(2_000_000)  # 8 MB, above glibc's default (dynamic) mmap threshold for a fresh process
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start


def test_opt_out_leaves_malloc_alone(monkeypatch):
    monkeypatch.setenv("GROUPRL_MALLOC_TUNING", "0")
    assert reuse_freed_host_memory() is False


def test_after_tuning_freed_blocks_are_reused_without_page_faults():
    import ctypes

    from grouprl import host_memory

    if not reuse_freed_host_memory():
        pytest.skip("not glibc: nothing to tune")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(host_memory.M_MMAP_THRESHOLD, 128 * 1024)  # glibc's starting thresholds, held fixed
    libc.mallopt(host_memory.M_TRIM_THRESHOLD, 128 * 1024)
    assert _faults_of_repeated_allocations() > 10_000  # every 8 MB block mapped afresh: a fault per page
    assert reuse_freed_host_memory()
    _faults_of_repeated_allocations()  # the heap grows once
    # 20 allocations of 8 MB = ~39,000 pages; reused from the heap they fault (almost) never.
    assert _faults_of_repeated_allocations() < 500
